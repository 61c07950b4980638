// `loom generate`: sample text from a checkpoint with a KV cache, streaming tokens as they come.
#include <fmt/format.h>

#include <chrono>
#include <sstream>

#include "loom/cli/commands.h"
#include "loom/error.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/model/generator.h"
#include "loom/model/sampling.h"
#include "loom/train/checkpoint.h"
#include "loom/train/tokenizer.h"

namespace loom::cli {

namespace {

struct GenerateOptions {
  std::string checkpoint, prompt, prompt_ids;
  int64_t max_tokens = 100;
  model::SamplingOptions sampling;
  bool quiet = false;
};

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::istringstream in(text);
  std::string tok;
  while (in >> tok) {
    try {
      size_t used = 0;
      long v = std::stol(tok, &used);
      if (used != tok.size()) throw std::invalid_argument(tok);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      throw ConfigError("--prompt-ids: '" + tok + "' is not a token id (give space-separated integers)");
    }
  }
  return ids;
}

int run_generate(const GenerateOptions& o) {
  const train::RunConfig cfg = train::checkpoint_config(o.checkpoint);
  const std::string tok_file = train::checkpoint_tokenizer(o.checkpoint);
  std::optional<train::Tokenizer> tokenizer;
  if (!tok_file.empty()) tokenizer.emplace(train::Tokenizer::load(tok_file));
  std::vector<int32_t> prompt;
  if (!o.prompt_ids.empty()) {
    prompt = parse_ids(o.prompt_ids);
  } else if (tokenizer) {
    prompt = tokenizer->encode(o.prompt);
  } else {
    throw ConfigError("checkpoint '" + o.checkpoint + "' was trained on synthetic tokens and has no tokenizer; " +
                      "give the prompt as --prompt-ids \"1 2 3\"");
  }
  if (prompt.empty()) throw ConfigError("the prompt is empty: give --prompt TEXT or --prompt-ids IDS");
  if (o.max_tokens < 0) throw ConfigError("--max-tokens must be >= 0");

  Allocator alloc;
  kernels::CpuBackend backend(alloc, nullptr, resolve_threads(cfg.train.threads));
  model::ParameterStore params(spec::build_param_table(cfg.model.resolved), model::Precision::FP32, alloc);
  train::load_model_weights(o.checkpoint, params);
  model::Generator gen(cfg.model.resolved, params, backend);
  const int64_t room = cfg.model.resolved.max_seq - static_cast<int64_t>(prompt.size());
  if (room < 0)
    throw ConfigError("the prompt has " + std::to_string(prompt.size()) + " tokens, more than the model's context of " +
                      std::to_string(cfg.model.resolved.max_seq));
  const int64_t n = std::min(o.max_tokens, room);
  if (!o.quiet && n < o.max_tokens)
    fmt::print(stderr, "note: stopping after {} tokens, where the model's context ({}) ends\n", n,
               cfg.model.resolved.max_seq);

  auto t0 = std::chrono::steady_clock::now();
  auto logits = gen.feed(prompt);
  if (tokenizer) fmt::print("{}", o.prompt);
  std::vector<int32_t> out;
  const int32_t eos = tokenizer ? tokenizer->eos_id() : -1;
  // Continuations are decoded together with the prompt: sentencepiece drops the leading space of a
  // text's first piece, so decoding the new tokens alone would glue them to the prompt.
  std::vector<int32_t> all = prompt;
  const std::string prompt_text = tokenizer ? tokenizer->decode(prompt) : "";
  std::string shown = prompt_text;
  for (int64_t i = 0; i < n; ++i) {
    int32_t next = model::sample_token(logits, o.sampling, static_cast<uint64_t>(i));
    if (next == eos) {
      if (!o.quiet) fmt::print(stderr, "[end of text]");
      break;
    }
    out.push_back(next);
    all.push_back(next);
    if (tokenizer) {
      // Print only what is new, and only once it decodes stably: a token can end mid-character.
      std::string text = tokenizer->decode(all);
      if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0) {
        fmt::print("{}", text.substr(shown.size()));
        std::fflush(stdout);
        shown = text;
      }
    } else {
      fmt::print("{}{}", i ? " " : "", next);
    }
    if (i + 1 < n) logits = gen.feed(std::span<const int32_t>(&next, 1));
  }
  fmt::print("\n");
  std::fflush(stdout);  // the text before the statistics on stderr, also when both go to one terminal
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!o.quiet)
    fmt::print(stderr, "generated {} tokens in {:.2f} s ({:.1f} tokens/s, prompt {} tokens, KV cache)\n", out.size(), s,
               out.size() / std::max(s, 1e-9), prompt.size());
  return 0;
}

}  // namespace

void register_generate(CLI::App& app, Action& action) {
  auto o = std::make_shared<GenerateOptions>();
  auto* cmd = app.add_subcommand("generate", "Sample text from a checkpoint (KV-cached decoding)");
  cmd->add_option("--checkpoint", o->checkpoint, "a step-N checkpoint folder, or a checkpoint dir (its latest)")
      ->required();
  // One prompt or the other: given both, the ids were generated from and the text printed.
  auto* text = cmd->add_option("--prompt", o->prompt, "text to continue (needs a checkpoint trained on prepared shards)");
  cmd->add_option("--prompt-ids", o->prompt_ids, "the prompt as space-separated token ids")->excludes(text);
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to generate (stops early at end of text)")
      ->capture_default_str()
      ->check(finite_range(1, 1 << 24));
  cmd->add_option("--temperature", o->sampling.temperature, "softmax temperature; 0 = greedy")
      ->capture_default_str()
      ->check(finite_range(0, 1e4));
  cmd->add_option("--top-k", o->sampling.top_k, "sample among the k most likely tokens; 0 = all")
      ->capture_default_str()
      ->check(finite_range(0, 2147483647));
  cmd->add_option("--seed", o->sampling.seed, "sampling seed (same seed, same text)")->capture_default_str();
  cmd->add_flag("-q,--quiet", o->quiet, "print only the text");
  cmd->callback([&action, o] { action = [o] { return run_generate(*o); }; });
}

}  // namespace loom::cli
