// A text corpus as `loom prepare` reads it: the text files under the given
// files and folders, in a stable order, each cut into documents (the unit of
// the train / validation split).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "loom/core/file_reader.h"

namespace loom::train {

struct CorpusFile {
  std::filesystem::path path;
  uint64_t bytes = 0;
};

struct SkippedFile {
  std::filesystem::path path;
  std::string reason;  // "binary", "duplicate of <path>", "hidden"
};

struct CorpusFiles {
  std::vector<CorpusFile> files;
  std::vector<SkippedFile> skipped;
  uint64_t total_bytes = 0;
};

// Expands `inputs` (files or folders, walked recursively) into the text files
// to read, sorted by path within each input so the corpus -- and hence the
// split and the shards -- is reproducible. Inside folders it skips hidden
// entries, binary files (a NUL byte in the first 64 KiB: fortune's
// `.dat` strfile indexes) and links to a file already read (fortune's `.u8`
// links). A file named explicitly must be text. Throws IoError naming the input
// when it is missing, binary, or when no text file is found.
CorpusFiles find_corpus_files(const std::vector<std::string>& inputs);

// Cuts one file's text into documents. Fortune files (any line that is exactly
// "%") are cut at those lines; other text is cut at blank lines (paragraphs).
// Each document keeps its inner newlines, loses trailing whitespace; documents
// that are only whitespace are dropped.
std::vector<std::string> split_documents(std::string_view text);

}  // namespace loom::train
