#include "loom/core/output_folder.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "loom/error.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

// A fresh scratch folder holding one regular file, "a-file".
fs::path scratch_with_a_file(const std::string& name) {
  const fs::path root = fs::temp_directory_path() / (name + "-" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  std::ofstream(root / "a-file") << "x";
  return root;
}

// What check_output_folder must refuse before a run starts, and what it must let through without
// creating anything.
TEST(OutputFolder, RefusesPathsThatCannotHoldFilesAndCreatesNothing) {
  const fs::path root = scratch_with_a_file("loom-output-folder");

  EXPECT_NO_THROW(check_output_folder((root / "new" / "deeper").string(), "checkpoint.dir"));
  EXPECT_FALSE(fs::exists(root / "new")) << "the check must create nothing";
  EXPECT_NO_THROW(check_output_folder(root.string(), "checkpoint.dir"));
  EXPECT_NO_THROW(check_output_folder("relative/folder", "checkpoint.dir"));

  auto refused = [&](const std::string& dir, const std::string& expect) {
    try {
      check_output_folder(dir, "checkpoint.dir");
      ADD_FAILURE() << dir << " was accepted";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("checkpoint.dir"), std::string::npos) << what;
      EXPECT_NE(what.find(expect), std::string::npos) << what;
    }
  };
  refused((root / "a-file").string(), "is a file, not a folder");
  refused((root / "a-file" / "ck").string(), "is a file, not a folder");
  refused((root / std::string(300, 'x')).string(), "longer than the");
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(root / "read-only");
    fs::permissions(root / "read-only", fs::perms::owner_read | fs::perms::owner_exec);
    refused((root / "read-only" / "ck").string(), "is not writable");
    fs::permissions(root / "read-only", fs::perms::owner_all);
  }
  fs::remove_all(root);
}

// A file an output will be written to: its folder as above, and the path itself must not be a folder.
TEST(OutputFolder, OutputFilesAreCheckedLikeTheirFolder) {
  const fs::path root = scratch_with_a_file("loom-output-file");
  EXPECT_NO_THROW(check_output_file((root / "new" / "hw.toml").string(), "--out"));
  EXPECT_NO_THROW(check_output_file((root / "a-file").string(), "--out"));  // replaced later, kept now
  EXPECT_FALSE(fs::exists(root / "new"));
  for (const auto& [path, expect] : std::vector<std::pair<fs::path, std::string>>{
           {root / "a-file" / "hw.toml", "is a file, not a folder"}, {root, "is a folder, not a file"}}) {
    try {
      check_output_file(path.string(), "--out");
      ADD_FAILURE() << path << " was accepted";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("--out '" + path.string() + "'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace loom
