// Typed errors with context, shared by every layer (header-only, below spec). Library code throws
// these; only the CLI prints them and exits. Each error names what is wrong and what would be valid.
#pragma once

#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A user-supplied value (config key, CLI flag, shape) is invalid.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Shapes or dtypes of tensors handed to an operation do not fit together.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A file is missing, unreadable or malformed.
class IoError : public Error {
 public:
  using Error::Error;
};

// Training diverged: a loss or gradient became NaN/Inf.
class NumericError : public Error {
 public:
  using Error::Error;
};

// The machine or a library cannot do what was asked (e.g. an ISA oneDNN refuses).
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

// A collective, the rendezvous or a transport failed: names the rank, group, op and peers involved.
class CommError : public Error {
 public:
  using Error::Error;
};

// A collective or rendezvous missed its deadline (LOOM_COMM_TIMEOUT): names who never arrived.
class CommTimeoutError : public CommError {
 public:
  using CommError::CommError;
};

}  // namespace loom
