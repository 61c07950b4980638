// What every fuzz target shares. For bad input a parser's loom::Error is the right answer; any other
// exception (std::out_of_range, a json type_error, bad_alloc from a hostile length) is a bug, and so is
// an error that does not name the file: both abort, so libFuzzer keeps the input as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include "loom/error.h"

namespace loom::fuzz {

[[noreturn]] inline void bug(const std::string& what) {
  std::fprintf(stderr, "fuzz: %s\n", what.c_str());
  std::abort();
}

// Runs `parse`; a loom::Error whose message names `origin` (unless empty) is the expected outcome of
// bad input. LOOM_FUZZ_SHOW_ERRORS=1 prints each one (why is this seed refused?).
template <typename F>
void expect_loom_errors(const std::string& origin, F&& parse) {
  static const bool show = std::getenv("LOOM_FUZZ_SHOW_ERRORS") != nullptr;
  try {
    parse();
    if (show) std::fprintf(stderr, "fuzz: accepted\n");
  } catch (const loom::Error& e) {
    if (show) std::fprintf(stderr, "fuzz: refused: %s\n", e.what());
    if (!origin.empty() && std::string_view(e.what()).find(origin) == std::string_view::npos)
      bug(std::string("the error does not name '") + origin + "': " + e.what());
  } catch (const std::exception& e) {
    bug(std::string("the parser threw ") + typeid(e).name() + ", not a loom::Error: " + e.what());
  }
}

inline std::string text(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// `bytes` cut at every occurrence of `sep` (the pieces, without it).
inline std::vector<std::string> split(std::string_view bytes, std::string_view sep) {
  std::vector<std::string> out;
  for (size_t at = 0;;) {
    size_t next = bytes.find(sep, at);
    out.emplace_back(bytes.substr(at, next == std::string_view::npos ? std::string_view::npos : next - at));
    if (next == std::string_view::npos) return out;
    at = next + sep.size();
  }
}

}  // namespace loom::fuzz
