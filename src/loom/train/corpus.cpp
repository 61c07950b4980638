#include "loom/train/corpus.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <system_error>

#include "loom/error.h"

namespace loom::train {

namespace fs = std::filesystem;

namespace {

// A NUL byte never occurs in text (any encoding Loom reads) but almost always
// in binary formats within the first few KiB, e.g. the big-endian version word
// that opens a strfile `.dat` index.
bool looks_binary(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw IoError("cannot read corpus file '" + p.string() + "': check its permissions");
  std::string head(64 * 1024, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  return head.find('\0') != std::string::npos;
}

bool hidden(const fs::path& p) {
  const std::string name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

fs::path canonical_or_self(const fs::path& p) {
  std::error_code ec;
  fs::path c = fs::canonical(p, ec);
  return ec ? p : c;
}

// Is the line (without its '\n') a document separator of the fortune format?
bool is_percent_line(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line == "%";
}

bool is_blank(std::string_view line) { return line.find_first_not_of(" \t\r\f\v") == std::string_view::npos; }

}  // namespace

CorpusFiles find_corpus_files(const std::vector<std::string>& inputs) {
  if (inputs.empty()) throw ConfigError("no input given: pass --input FILE_OR_FOLDER (e.g. /usr/share/games/fortunes)");
  CorpusFiles out;
  std::set<fs::path> seen;  // canonical paths already taken
  auto take = [&](const fs::path& p, const fs::path& canon) {
    seen.insert(canon);
    std::error_code ec;
    const uint64_t n = fs::file_size(p, ec);
    if (ec) throw IoError("cannot stat corpus file '" + p.string() + "': " + ec.message());
    out.files.push_back({p, n});
    out.total_bytes += n;
  };
  for (const auto& input : inputs) {
    const fs::path root(input);
    std::error_code ec;
    const auto st = fs::status(root, ec);
    if (ec || !fs::exists(st))
      throw IoError("input '" + input +
                    "' does not exist (for the default corpus install Debian's `fortunes` package: scripts/setup.sh)");
    if (fs::is_regular_file(st)) {
      if (looks_binary(root))
        throw IoError("input '" + input + "' is a binary file, not text: pass text files or folders");
      const fs::path canon = canonical_or_self(root);
      if (!seen.count(canon)) take(root, canon);
      continue;
    }
    if (!fs::is_directory(st)) throw IoError("input '" + input + "' is neither a file nor a folder");

    // Regular files first, then links, so that a link is dropped in favour of
    // the file it names whatever their names' order (fortune's `art.u8 ->
    // art`).
    std::vector<fs::path> files, links;
    for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const fs::path& p = it->path();
      if (hidden(p)) {
        if (it->is_directory()) it.disable_recursion_pending();
        out.skipped.push_back({p, "hidden"});
        continue;
      }
      if (it->is_symlink()) {
        if (fs::is_regular_file(p)) links.push_back(p);  // a link to a folder is not followed
      } else if (it->is_regular_file()) {
        files.push_back(p);
      }
    }
    if (ec) throw IoError("cannot walk folder '" + input + "': " + ec.message());
    std::sort(files.begin(), files.end());
    std::sort(links.begin(), links.end());
    const size_t first_new = out.files.size();
    for (const auto* group : {&files, &links}) {
      for (const auto& p : *group) {
        const fs::path canon = canonical_or_self(p);
        if (seen.count(canon)) {
          out.skipped.push_back({p, "duplicate of " + canon.string()});
        } else if (looks_binary(p)) {
          out.skipped.push_back({p, "binary"});
        } else {
          take(p, canon);
        }
      }
    }
    // Keep each input's files in path order (links were appended after the
    // files).
    std::sort(out.files.begin() + static_cast<std::ptrdiff_t>(first_new), out.files.end(),
              [](const CorpusFile& a, const CorpusFile& b) { return a.path < b.path; });
  }
  if (out.files.empty())
    throw IoError("no text files found in the inputs (" + std::to_string(out.skipped.size()) +
                  " skipped as binary, hidden or duplicate): pass folders or files holding text");
  return out;
}

std::vector<std::string> split_documents(std::string_view text) {
  // Lines without their '\n'.
  std::vector<std::string_view> lines;
  for (size_t pos = 0; pos < text.size();) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) nl = text.size();
    lines.push_back(text.substr(pos, nl - pos));
    pos = nl + 1;
  }
  const bool fortune = std::any_of(lines.begin(), lines.end(), is_percent_line);
  auto separator = [&](std::string_view l) { return fortune ? is_percent_line(l) : is_blank(l); };

  std::vector<std::string> docs;
  std::string cur;
  auto flush = [&] {
    // Trailing whitespace carries nothing; leading blank lines neither. Leading
    // spaces on the first line stay (indentation matters in verse and ASCII
    // art).
    const size_t end = cur.find_last_not_of(" \t\r\n\f\v");
    if (end != std::string::npos) {
      cur.resize(end + 1);
      size_t begin = 0;
      while (begin < cur.size()) {
        size_t nl = cur.find('\n', begin);
        if (nl == std::string::npos || !is_blank(std::string_view(cur).substr(begin, nl - begin))) break;
        begin = nl + 1;
      }
      docs.push_back(cur.substr(begin));
    }
    cur.clear();
  };
  for (auto l : lines) {
    if (separator(l)) {
      flush();
      continue;
    }
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);  // CRLF files: documents use '\n'
    cur.append(l);
    cur.push_back('\n');
  }
  flush();
  return docs;
}

}  // namespace loom::train
