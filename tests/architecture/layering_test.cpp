// The layers of src/loom/ depend only downward. The link graph (src/loom/CMakeLists.txt) already stops
// a wrong-way call into a .cpp, but a header-only include of a higher layer links fine and tangles the
// layers all the same. This test reads the allowed graph from the CMake file itself and checks every
// #include of every source and header against it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace {

const fs::path kSrc = fs::path(LOOM_SOURCE_DIR) / "src" / "loom";

// layer -> the layers it links directly, from `loom_layer(name deps...)`.
std::map<std::string, std::set<std::string>> declared_layers() {
  std::ifstream in(kSrc / "CMakeLists.txt");
  std::stringstream text;
  text << in.rdbuf();
  const std::string s = text.str();
  std::map<std::string, std::set<std::string>> deps;
  const std::regex call(R"(\n\s*loom_layer\(([a-z_]+)([^)]*)\))");
  for (auto it = std::sregex_iterator(s.begin(), s.end(), call); it != std::sregex_iterator(); ++it) {
    auto& d = deps[(*it)[1].str()];
    const std::string args = (*it)[2].str();
    const std::regex dep(R"(\bloom_([a-z_]+)\b)");
    for (auto a = std::sregex_iterator(args.begin(), args.end(), dep); a != std::sregex_iterator(); ++a)
      if ((*a)[1].str() != "dnnl") d.insert((*a)[1].str());
  }
  return deps;
}

std::set<std::string> reachable(const std::map<std::string, std::set<std::string>>& deps, const std::string& from) {
  std::set<std::string> seen{from};
  std::vector<std::string> todo{from};
  while (!todo.empty()) {
    const std::string l = todo.back();
    todo.pop_back();
    auto it = deps.find(l);
    if (it == deps.end()) continue;
    for (const auto& d : it->second)
      if (seen.insert(d).second) todo.push_back(d);
  }
  return seen;
}

TEST(Layering, NoLayerIncludesALayerAboveIt) {
  const auto deps = declared_layers();
  ASSERT_GE(deps.size(), 9u) << "could not read the layers from src/loom/CMakeLists.txt";
  // `profile` is usable from every layer (ARCHITECTURE.md), which CMake expresses by linking it where used.
  const std::regex include(R"(#include\s+"loom/([a-z_]+)/)");
  int files = 0;
  std::vector<std::string> wrong;
  for (const auto& [layer, _] : deps) {
    const auto allowed = reachable(deps, layer);
    for (const auto& e : fs::recursive_directory_iterator(kSrc / layer)) {
      const auto ext = e.path().extension();
      if (!e.is_regular_file() || (ext != ".h" && ext != ".cpp")) continue;
      ++files;
      std::ifstream in(e.path());
      std::string line;
      for (int n = 1; std::getline(in, line); ++n) {
        std::smatch m;
        if (std::regex_search(line, m, include) && !allowed.contains(m[1].str()))
          wrong.push_back(fs::relative(e.path(), kSrc).string() + ":" + std::to_string(n) + " includes loom/" +
                          m[1].str() + "/ but " + layer + " links only the layers below it");
      }
    }
  }
  EXPECT_GT(files, 100);
  for (const auto& w : wrong) ADD_FAILURE() << w;
}

TEST(Layering, TheModelLinksNoCollectives) {
  // Tensor parallelism reaches the model through its op interface, never through comm directly.
  const auto deps = declared_layers();
  EXPECT_FALSE(reachable(deps, "model").contains("comm"));
  EXPECT_FALSE(reachable(deps, "model").contains("parallel"));
  EXPECT_FALSE(reachable(deps, "plan").contains("kernels"));  // the planner reads descriptions only
}

}  // namespace
