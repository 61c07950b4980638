// Names and fingerprints derived from a secret with a keyed hash (HMAC-SHA256, OpenSSL): they identify
// the secret's job without telling anything about the secret, so they may appear where every local
// user can look (file names under /dev/shm, logs, error messages).
#pragma once

#include <string>
#include <string_view>

namespace loom {

// HMAC-SHA256(key, message) as 64 lowercase hex digits. `key` may be any byte string.
std::string hmac_sha256_hex(std::string_view key, std::string_view message);

// A short public name for what `secret` guards, separated by `purpose` ("job id", "fingerprint"), so two
// uses of one secret never give the same string: the first `digits` hex digits of the HMAC.
std::string derived_id(std::string_view secret, std::string_view purpose, size_t digits = 12);

}  // namespace loom
