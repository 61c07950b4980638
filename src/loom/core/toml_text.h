// Writing TOML by hand where Loom emits files it reads back (the resolved config in manifests, the
// hardware file `loom calibrate` writes): one basic-string escaper for both. Not toml++'s printer: it
// writes a string starting with a newline as a multi-line literal string, whose first newline a reader
// drops (found by fuzz/hardware_fuzz).
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace loom {

// `s` as a TOML basic string: quotes and backslashes escaped, control characters as \uXXXX.
inline std::string toml_basic_string(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

}  // namespace loom
