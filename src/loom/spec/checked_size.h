// Sizes computed from user input (element counts, bytes, token offsets) with every product and sum
// checked: an overflow throws a ConfigError that names the config keys the size came from and their
// values, before anything is allocated. A wrapped size is the worst kind of bad input: it passes every
// later check and fails as a segfault, or as a silently small buffer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/error.h"

namespace loom::spec {

class CheckedSize {
 public:
  // The value of a config key (or of another named quantity): `what` is what an error names.
  CheckedSize(int64_t value, std::string what) : v_(value), keys_{std::move(what) + " = " + std::to_string(value)} {
    if (value < 0) throw ConfigError(keys_[0] + " must not be negative");
  }
  // A constant of the formula, shown as its value.
  static CheckedSize constant(int64_t value) { return CheckedSize(value); }

  int64_t value() const { return v_; }
  // The keys (with their values) the size was computed from, in order of first use.
  std::string sources() const {
    std::string s;
    for (const auto& k : keys_) s += (s.empty() ? "" : ", ") + k;
    return s;
  }

  friend CheckedSize operator*(const CheckedSize& a, const CheckedSize& b) {
    int64_t r = 0;
    if (__builtin_mul_overflow(a.v_, b.v_, &r)) overflow(a, b);
    return CheckedSize(r, a, b);
  }
  friend CheckedSize operator+(const CheckedSize& a, const CheckedSize& b) {
    int64_t r = 0;
    if (__builtin_add_overflow(a.v_, b.v_, &r)) overflow(a, b);
    return CheckedSize(r, a, b);
  }
  CheckedSize& operator*=(const CheckedSize& b) { return *this = *this * b; }
  CheckedSize& operator+=(const CheckedSize& b) { return *this = *this + b; }

  // Throws unless the value is at most `limit`; `what` says what the size is ("parameters", "bytes of
  // the logits"), `fix` how to bring it down.
  const CheckedSize& at_most(int64_t limit, const std::string& what, const std::string& fix) const {
    if (v_ > limit)
      throw ConfigError(what + " = " + std::to_string(v_) + " exceeds " + std::to_string(limit) + " (from " + sources() +
                        "); " + fix);
    return *this;
  }

 private:
  explicit CheckedSize(int64_t constant) : v_(constant) {}
  CheckedSize(int64_t v, const CheckedSize& a, const CheckedSize& b) : v_(v), keys_(a.keys_) {
    for (const auto& k : b.keys_)
      if (std::find(keys_.begin(), keys_.end(), k) == keys_.end()) keys_.push_back(k);
  }
  [[noreturn]] static void overflow(const CheckedSize& a, const CheckedSize& b) {
    throw ConfigError("a size computed from " + CheckedSize(0, a, b).sources() +
                      " does not fit in 64 bits: lower these keys");
  }

  int64_t v_;
  std::vector<std::string> keys_;  // "model.d_model = 768", ...
};

}  // namespace loom::spec
