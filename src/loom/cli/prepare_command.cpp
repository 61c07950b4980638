// `loom prepare`: text files or folders -> sentencepiece BPE tokenizer ->
// memory-mappable token shards split by document into train and validation,
// with a progress display on stderr.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "loom/cli/commands.h"
#include "loom/core/checksum.h"
#include "loom/train/prepare.h"

namespace loom::cli {

namespace {

struct PrepareCliOptions {
  train::PrepareOptions prep;
  bool quiet = false;
  bool json = false;
};

std::string mib(uint64_t bytes) { return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / 1048576.0); }

// "12,345": token and document counts read at a glance.
std::string grouped(int64_t v) {
  const std::string s = std::to_string(v);
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && s[i - 1] != '-' && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

// Draws the progress of each phase: on a terminal one line redrawn at most 10
// times a second; in a log (not a terminal) one line per phase, so CI output
// stays short.
std::string corpus_line(const train::CorpusFiles& files, int64_t documents) {
  std::map<std::string, int> skipped;  // reason kind -> count
  for (const auto& f : files.skipped) skipped[f.reason.substr(0, f.reason.find(' '))]++;
  std::string skip_text;
  for (const auto& [why, n] : skipped) skip_text += fmt::format("{}{} {}", skip_text.empty() ? "" : ", ", n, why);
  return fmt::format("corpus: {} text files, {}, {} documents{}", files.files.size(), mib(files.total_bytes),
                     grouped(documents), skip_text.empty() ? "" : " (skipped " + skip_text + ")");
}

class ProgressDisplay {
 public:
  ProgressDisplay(bool quiet, int vocab) : quiet_(quiet), tty_(isatty(STDERR_FILENO)), vocab_(vocab) {}

  void operator()(const train::PrepareProgress& p) {
    using Phase = train::PrepareProgress::Phase;
    if (quiet_) return;
    const auto now = std::chrono::steady_clock::now();
    if (p.phase != phase_) {
      end_line();
      if (phase_ == Phase::Scan && p.files) say(corpus_line(*p.files, docs_));
      phase_ = p.phase;
      phase_start_ = now;
      if (p.phase == Phase::TokenizerTrain) say(fmt::format("tokenizer: learning BPE merges (vocab {}) ...", vocab_));
    }
    if (p.phase == Phase::Scan) docs_ = p.documents;
    if (!tty_ || p.phase == Phase::Done || p.phase == Phase::TokenizerTrain) return;
    if (now - last_draw_ < std::chrono::milliseconds(100) && p.bytes_done < p.bytes_total) return;
    last_draw_ = now;
    const double frac = p.bytes_total ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total) : 1.0;
    const double secs = std::chrono::duration<double>(now - phase_start_).count();
    const double rate = secs > 0 ? static_cast<double>(p.bytes_done) / secs : 0;
    const double eta = rate > 0 ? static_cast<double>(p.bytes_total - p.bytes_done) / rate : NAN;
    const int filled = static_cast<int>(frac * 20);
    std::string line = fmt::format("{:<9} [{}{}] {:3.0f}% {}/{} | {} docs", label(p.phase), std::string(filled, '#'),
                                   std::string(20 - filled, '-'), 100 * frac, mib(p.bytes_done), mib(p.bytes_total),
                                   grouped(p.documents));
    if (p.phase == Phase::Encode)
      line += fmt::format(" | {} tokens | {:.1f} MiB/s | ETA {}", grouped(p.tokens), rate / 1048576.0,
                          std::isfinite(eta) ? fmt::format("{:.0f}s", eta) : "?");
    fmt::print(stderr, "\r\033[K{}", line);
    open_line_ = true;
  }

  void say(const std::string& line) {
    if (quiet_) return;
    end_line();
    fmt::print(stderr, "{}\n", line);
  }

 private:
  static const char* label(train::PrepareProgress::Phase ph) {
    switch (ph) {
      case train::PrepareProgress::Phase::Scan:
        return "scanning";
      case train::PrepareProgress::Phase::TokenizerRead:
        return "tokenizer";
      case train::PrepareProgress::Phase::Encode:
        return "encoding";
      default:
        return "";
    }
  }
  void end_line() {
    if (open_line_) fmt::print(stderr, "\n");
    open_line_ = false;
  }
  bool quiet_, tty_;
  int vocab_;
  int64_t docs_ = 0;
  bool open_line_ = false;
  train::PrepareProgress::Phase phase_ = train::PrepareProgress::Phase::Scan;
  std::chrono::steady_clock::time_point phase_start_ = std::chrono::steady_clock::now(), last_draw_{};
};

int run_prepare(const PrepareCliOptions& o) {
  ProgressDisplay show(o.quiet, o.prep.vocab_size);
  train::PrepareOptions prep = o.prep;
  prep.threads = resolve_threads(prep.threads);
  auto r = train::prepare_corpus(prep, [&](const train::PrepareProgress& p) { show(p); });
  const auto& s = r.set;

  show.say(fmt::format("split: {} documents -> train {} / validation {} (by document, seed {}, fraction {})",
                       grouped(s.train_documents + s.validation_documents), grouped(s.train_documents),
                       grouped(s.validation_documents), s.seed, s.val_fraction));
  show.say(fmt::format("tokenizer: {} BPE, vocab {} in {:.1f} s -> {} (hash {})",
                       s.tokenizer_trained ? "trained" : "reused", s.vocab_size, r.tokenizer_seconds,
                       (prep.out_dir / s.tokenizer_file).string(), checksum_hex(s.tokenizer_hash)));
  const double total_tokens = static_cast<double>(s.train_tokens + s.validation_tokens);
  show.say(fmt::format("done in {:.1f} s: {} tokens (train {} / validation {}, {:.2f} bytes/token) in {} shards -> {}",
                       r.seconds, grouped(s.train_tokens + s.validation_tokens), grouped(s.train_tokens),
                       grouped(s.validation_tokens),
                       total_tokens > 0 ? static_cast<double>(r.files.total_bytes) / total_tokens : 0.0,
                       s.shards.size(), (prep.out_dir / train::kShardSetManifest).string()));
  if (o.json) {
    nlohmann::json j{{"out", prep.out_dir.string()},
                     {"files", r.files.files.size()},
                     {"bytes", r.files.total_bytes},
                     {"documents", {{"train", s.train_documents}, {"validation", s.validation_documents}}},
                     {"tokens", {{"train", s.train_tokens}, {"validation", s.validation_tokens}}},
                     {"shards", s.shards.size()},
                     {"vocab_size", s.vocab_size},
                     {"seconds", r.seconds},
                     {"tokenizer_seconds", r.tokenizer_seconds}};
    fmt::print("{}\n", j.dump());
  }
  return 0;
}

}  // namespace

void register_prepare(CLI::App& app, Action& action) {
  auto o = std::make_shared<PrepareCliOptions>();
  o->prep.threads = 0;
  auto* cmd = app.add_subcommand("prepare", "Tokenize a text corpus into memory-mapped train/validation shards");
  cmd->add_option("-i,--input", o->prep.inputs,
                  "text files or folders (walked recursively; binary files, hidden files and links to files already "
                  "read are skipped), e.g. /usr/share/games/fortunes")
      ->required()
      ->expected(1, -1);
  cmd->add_option("-o,--out", o->prep.out_dir, "folder to write tokenizer.model, the shards and manifest.json into")
      ->required();
  auto* vocab = cmd->add_option("--vocab-size", o->prep.vocab_size,
                                "BPE vocabulary to train; must equal the model's model.vocab_size")
                    ->capture_default_str()
                    ->check(CLI::Range(260, 1 << 24));
  cmd->add_option("--tokenizer", o->prep.tokenizer,
                  "reuse this sentencepiece model (e.g. another shard set's tokenizer.model) instead of training one")
      ->check(CLI::ExistingFile)
      ->excludes(vocab);
  cmd->add_option("--val-fraction", o->prep.val_fraction, "share of documents held out for validation, in [0, 1)")
      ->capture_default_str()
      ->check(finite_range(0.0, 0.999999));
  cmd->add_option("--seed", o->prep.seed, "seed of the train/validation split")->capture_default_str();
  cmd->add_option("--shard-tokens", o->prep.shard_tokens,
                  "tokens per shard (a shard ends after the document reaching it)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--threads", o->prep.threads, "threads for tokenizer training (0: all cores; LOOM_THREADS overrides)")
      ->capture_default_str()
      ->check(finite_range(0, 4096));
  cmd->add_flag("--overwrite", o->prep.overwrite, "replace a shard set already in --out (refused otherwise)");
  cmd->add_flag("-q,--quiet", o->quiet, "no progress output");
  cmd->add_flag("--json", o->json, "print a one-line JSON summary on stdout at the end");
  cmd->footer(
      "Documents: fortune files (lines that are exactly '%') are cut at those lines, other text at blank lines.\nThe "
      "split is by document; every document ends with the tokenizer's end-of-document token.\nTrain on the result "
      "with: loom train --set data.source=shards --set data.dir=OUT");
  cmd->callback([&action, o] { action = [o] { return run_prepare(*o); }; });
}

}  // namespace loom::cli
