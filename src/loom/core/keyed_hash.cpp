#include "loom/core/keyed_hash.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>

#include "loom/error.h"

namespace loom {

std::string hmac_sha256_hex(std::string_view key, std::string_view message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // An empty key is still a valid HMAC key; OpenSSL wants a non-null pointer for it.
  static const unsigned char kEmpty = 0;
  const void* k = key.empty() ? static_cast<const void*>(&kEmpty) : static_cast<const void*>(key.data());
  if (HMAC(EVP_sha256(), k, static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
           message.size(), mac, &len) == nullptr)
    throw Error("HMAC-SHA256 failed (OpenSSL)");
  static const char* digits = "0123456789abcdef";
  std::string hex(2 * len, '0');
  for (unsigned int i = 0; i < len; ++i) {
    hex[2 * i] = digits[mac[i] >> 4];
    hex[2 * i + 1] = digits[mac[i] & 15];
  }
  return hex;
}

std::string derived_id(std::string_view secret, std::string_view purpose, size_t digits) {
  std::string h = hmac_sha256_hex(secret, std::string("loom ") + std::string(purpose));
  h.resize(std::min(digits, h.size()));
  return h;
}

}  // namespace loom
