// Shared by the data tests: a fresh seed per run (printed, so a failure can be
// replayed with LOOM_TEST_SEED), scratch folders, and synthetic text with
// enough distinct words for a small BPE.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "../test_support.h"
#include <string>
#include <vector>

namespace loom::test {


inline void log_seed() {
  std::cout << "[ seed     ] LOOM_TEST_SEED=" << fresh_seed() << "\n";
  ::testing::Test::RecordProperty("seed", std::to_string(fresh_seed()));
}

inline std::filesystem::path scratch_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("loom-data-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

inline void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A made-up language: words of 1-4 syllables, sentences of 3-12 words, some
// punctuation.
class TextGen {
 public:
  explicit TextGen(uint64_t seed) : rng_(seed) {}
  std::string word() {
    static const char* syl[] = {"ka",  "lo",  "mi",  "ne",  "ru",  "sa",  "to", "vi", "den", "mar", "pol", "quen",
                                "tha", "zor", "bel", "ish", "gra", "fen", "hu", "wy", "ost", "ek",  "jo",  "cra"};
    std::string w;
    const int n = 1 + static_cast<int>(rng_() % 4);
    for (int i = 0; i < n; ++i) w += syl[rng_() % (sizeof(syl) / sizeof(syl[0]))];
    return w;
  }
  std::string sentence() {
    std::string s;
    const int n = 3 + static_cast<int>(rng_() % 10);
    for (int i = 0; i < n; ++i) {
      if (i) s += ' ';
      s += word();
    }
    static const char* end[] = {".", "!", "?", ",", ";", " -- 42."};
    s += end[rng_() % 6];
    s[0] = static_cast<char>(std::toupper(s[0]));
    return s;
  }
  // A document of 1-4 lines, tagged with `id` so each one is unique.
  std::string document(int id) {
    // (Appends, not operator+ on temporaries: GCC 12 raises a false -Wrestrict
    // on those.)
    std::string d = "Note ";
    d += std::to_string(id);
    d += ": ";
    d += sentence();
    const int lines = static_cast<int>(rng_() % 4);
    for (int i = 0; i < lines; ++i) {
      d += '\n';
      d += sentence();
    }
    return d;
  }
  // A fortune-format file (documents between '%' lines); returns the documents
  // written.
  std::vector<std::string> fortune_file(const std::filesystem::path& p, int first_id, int n) {
    std::vector<std::string> docs;
    std::string text;
    for (int i = 0; i < n; ++i) {
      docs.push_back(document(first_id + i));
      text += docs.back() + "\n%\n";
    }
    write_text(p, text);
    return docs;
  }
  uint64_t next() { return rng_(); }

 private:
  std::mt19937_64 rng_;
};

}  // namespace loom::test
