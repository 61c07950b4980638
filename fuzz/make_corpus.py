#!/usr/bin/env python3
"""Writes the seed corpus under fuzz/corpus/ (docs/fuzzing.md).

Real Loom output first: a built `loom` prepares a tiny shard set and trains two tiny checkpoints (gpt2
on synthetic data, llama on the shards), whose files become seeds; then the repository's own configs,
hardware files and validation table; then a few hand-made edge cases per format. Run from the
repository root after building:  python3 fuzz/make_corpus.py build/loom
The output is deterministic except for the checkpoints' run ids and times, and is committed.
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def read(path):
    with open(path, "rb") as f:
        return f.read()


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)] -> a file's bytes, laid out as Loom writes them."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


def frame(code, *fields):
    body = bytes([code]) + b"".join(struct.pack("<I", len(f)) + f for f in fields)
    return struct.pack("<I", len(body)) + body


def u64(v):
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


def main():
    loom = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "loom"))
    for t in os.listdir(CORPUS) if os.path.isdir(CORPUS) else []:
        shutil.rmtree(os.path.join(CORPUS, t))
    work = tempfile.mkdtemp(prefix="loom-corpus-")
    try:
        run = lambda *a: subprocess.run([loom, *a], cwd=work, check=True, stdout=subprocess.DEVNULL)
        with open("/usr/share/games/fortunes/fortunes", "rb") as f:
            text = f.read(6000)
        with open(os.path.join(work, "small.txt"), "wb") as f:
            f.write(text)
        run("prepare", "-i", "small.txt", "-o", "data", "--vocab-size", "400", "--val-fraction", "0.2",
            "--shard-tokens", "400", "-q", "--threads", "1")
        tiny = ["--set", "model.d_model=8", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
                "--set", "model.n_kv_heads=2", "--set", "model.d_ff=16", "--set", "model.max_seq=8",
                "--set", "train.steps=2", "--set", "train.batch_size=2", "--set", "train.seq_len=8",
                "--set", "train.warmup_steps=1", "--set", "train.eval_every=0", "--set", "train.threads=1"]
        run("train", "--set", "model.preset=tiny", *tiny, "--set", "model.vocab_size=16", "--set",
            "train.out_dir=run1", "--save-every", "2", "--save-dir", "ck1", "-q")
        run("train", "--set", "model.preset=tiny-llama", *tiny, "--set", "model.n_kv_heads=1", "--set",
            "model.vocab_size=400", "--set", "data.source=shards", "--set", "data.dir=data", "--set",
            "train.out_dir=run2", "--save-every", "2", "--save-dir", "ck2", "-q")
        ck1, ck2 = os.path.join(work, "ck1", "step-00000002"), os.path.join(work, "ck2", "step-00000002")

        # safetensors: Loom's own checkpoint files, then small hand-made ones.
        put("safetensors", "gpt2-model.safetensors", read(os.path.join(ck1, "model.safetensors")))
        put("safetensors", "gpt2-optimizer.safetensors", read(os.path.join(ck1, "optimizer.safetensors")))
        f32 = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
        put("safetensors", "dtypes.safetensors", safetensors(
            [("a", "F32", [2, 3], f32), ("b", "BF16", [2], b"\x80\x3f\x00\x40"), ("c", "I64", [1], u64(7)),
             ("d", "I32", [1, 1], struct.pack("<i", -1)), ("e", "F64", [], struct.pack("<d", 0.5))], {"format": "pt"}))
        put("safetensors", "empty-tensor.safetensors", safetensors([("z", "F32", [0, 4], b"")]))
        put("safetensors", "metadata-only.safetensors", safetensors([], {"k": "v", "format": "pt"}))

        # checkpoint manifests
        put("checkpoint_manifest", "gpt2-synthetic.json", read(os.path.join(ck1, "manifest.json")))
        put("checkpoint_manifest", "llama-shards.json", read(os.path.join(ck2, "manifest.json")))
        small = {"format": "loom-checkpoint", "version": 1, "step": 3, "run_id": "r", "optimizer": {"steps": 3},
                 "tokenizer": None, "config_toml": "[model]\npreset = \"tiny\"\n",
                 "tensors": [{"name": "w", "param": "w", "file": "model.safetensors", "checksum": "00"},
                             {"name": "exp_avg.w", "param": "w", "file": "optimizer.safetensors", "checksum": "01"}]}
        put("checkpoint_manifest", "small.json", json.dumps(small, indent=1))
        small["tokenizer"] = {"file": "tokenizer.model", "hash": "0123456789abcdef"}
        put("checkpoint_manifest", "small-tokenizer.json", json.dumps(small))

        # shards: a control byte (fuzz/shard_header_fuzz.cpp) and the file.
        data = os.path.join(work, "data")
        put("shard_header", "train-00007.bin", b"\x00" + read(os.path.join(data, "train-00007.bin")))
        put("shard_header", "validation-00001.bin", b"\x04" + read(os.path.join(data, "validation-00001.bin")))
        put("shard_header", "train-00000-mapped.bin", b"\x08" + read(os.path.join(data, "train-00000.bin")))
        shard = bytearray(read(os.path.join(data, "train-00007.bin")))
        tokens = struct.unpack_from("<%dH" % ((len(shard) - 64) // 2), shard, 64)
        wide = shard[:64] + struct.pack("<%dI" % len(tokens), *tokens)
        struct.pack_into("<IQ", wide, 12, 4, len(tokens))
        struct.pack_into("<I", wide, 40, 70000)  # a vocabulary that needs u32 tokens
        put("shard_header", "u32-tokens-fix-checksums.bin", b"\x03" + bytes(wide))

        # shard-set manifests
        manifest = json.loads(read(os.path.join(data, "manifest.json")))
        put("shard_set", "manifest.json", read(os.path.join(data, "manifest.json")))
        manifest["shards"] = manifest["shards"][:1]
        manifest["split"]["validation_document_ids"] = [0, 5]
        manifest["tokenizer"]["trained"] = False
        put("shard_set", "one-shard.json", json.dumps(manifest, separators=(",", ":")))

        # run configs: the repository's, the resolved ones in the manifests, and overrides (NUL-separated).
        for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
            if name.endswith(".toml"):
                put("run_config", name, read(os.path.join(ROOT, "configs", name)))
        put("run_config", "resolved-gpt2.toml", json.loads(read(os.path.join(ck1, "manifest.json")))["config_toml"])
        put("run_config", "resolved-llama.toml", json.loads(read(os.path.join(ck2, "manifest.json")))["config_toml"])
        put("run_config", "overrides.toml", read(os.path.join(ROOT, "configs", "tiny.toml")) +
            b"\0train.lr=3e-4\0model.preset=tiny-llama\0data.dir=some words\0parallel.dp=2")
        put("run_config", "empty-with-override.toml", b"\0precision=bf16")

        # planner files
        for name in sorted(os.listdir(os.path.join(ROOT, "configs", "hardware"))):
            put("hardware", name, read(os.path.join(ROOT, "configs", "hardware", name)))
        put("hardware", "minimal.toml", "[device]\npeak_tflops = { bf16 = 1 }\nmemory_GiB = 1\n"
            "memory_bandwidth_GBps = 1\n[node]\ndevices = 1\n[intra_node]\nbandwidth_GBps = 1\nlatency_us = 1\n"
            "topology = \"ring\"\n[inter_node]\nbandwidth_GBps = 1\nlatency_us = 1\n")
        table = read(os.path.join(ROOT, "tests", "plan", "published_results.toml"))
        put("validation", "published_results.toml", table)
        put("validation", "one-row.toml", "[[row]]\nname = \"r\"\nmodel = \"gpt3-175b\"\nhardware = \"a100\"\n"
            "software = \"megatron\"\nddp = \"torch\"\ndevices = 64\nseq = 2048\nglobal_batch = 512\ntp = 8\npp = 2\n"
            "micro_batch = 1\nvpp = 2\ntflops_96 = 140\nstate_GiB = 10\n")

        # the store: bodies (without the length) for store_wire; sessions for store_server.
        requests = [frame(1, b"fuzz-secret"), frame(2, b"key", b"value"), frame(3, b"key", u64(1000)),
                    frame(4, b"key"), frame(5, b"n", u64(1)), frame(5, b"n", u64(-1)),
                    frame(6, u64(0), b"key", b"other"), frame(7, b"key", b"other"), frame(8, b"key")]
        for i, r in enumerate(requests + [frame(100), frame(100, u64(5)), frame(102, b"a", b"b"), frame(103, b"no")]):
            put("store_wire", "body-%02d" % i, r[4:])
        put("store_server", "session", b"\x01" + b"".join(requests[1:]))
        put("store_server", "wrong-secret", b"\x00" + frame(1, b"not-it") + frame(2, b"k", b"v"))
        put("store_server", "not-hello-first", b"\x00" + frame(2, b"k", b"v"))
        put("store_server", "add-not-integer", b"\x01" + frame(2, b"k", b"x") + frame(5, b"k", u64(1)))
        # connection 0 parks a get and a wait; connection 1 sets the keys and wakes them; a get expires.
        put("store_server", "wake-waiters", b"\x01" + frame(3, b"late", u64(60000)) + frame(6, u64(60000), b"x") +
            b"CONN" + frame(2, b"late", b"1") + frame(2, b"x", b"2") + b"CONN" + frame(3, b"never", u64(0)))
        put("store_server", "malformed", b"\x01" + frame(9) + frame(2, b"only-one-field"))
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
