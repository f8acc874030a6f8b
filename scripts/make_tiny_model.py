#!/usr/bin/env python
"""Generate the project's tiny test models and LoRA adapters (random weights, deterministic).

Run with the engine venv's interpreter (it needs torch, transformers, tokenizers, peft):

    var/engine-venv/bin/python scripts/make_tiny_model.py [--force]

Writes under ${MODELS_DIR:-var/models} (relative to the repo root):

    tiny-llama/            Llama, 2 layers, hidden 128, 2 heads (head_dim 64), 1 KV head, fp32
    tiny-llama-lora-a/     LoRA r=8 for tiny-llama (q,k,v,o_proj), seed 101
    tiny-llama-lora-b/     LoRA r=8 for tiny-llama, seed 102
    tiny-llama-lora-c/     LoRA r=8 for tiny-llama, seed 103
    tiny-llama-lora-r32/   LoRA r=32 for tiny-llama (above a max_lora_rank of 16)
    tiny-wide/             Llama, 2 layers, hidden 256, 4 heads (head_dim 64), 1 KV head, fp32
    tiny-wide-lora/        LoRA r=8 for tiny-wide (wrong base for tiny-llama)
    .complete              written last; contains GENERATOR_VERSION

Weights are random: outputs are gibberish, but tokenizer, chat template, KV cache and LoRA paths
are all real. Output is byte-for-byte reproducible for a given package set.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

GENERATOR_VERSION = "tiny-models-v1"

REPO_ROOT = Path(__file__).resolve().parent.parent

VOCAB_SIZE = 1024  # tokenizer target and model vocab_size (model vocab >= tokenizer vocab)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

# Messages may be plain strings or OpenAI-style lists of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

MODELS = {
    # name: (hidden, heads, kv_heads, intermediate, layers, seed)
    "tiny-llama": (128, 2, 1, 256, 2, 1),
    "tiny-wide": (256, 4, 1, 512, 2, 2),
}

ADAPTERS = {
    # name: (base, rank, alpha, seed)
    "tiny-llama-lora-a": ("tiny-llama", 8, 16, 101),
    "tiny-llama-lora-b": ("tiny-llama", 8, 16, 102),
    "tiny-llama-lora-c": ("tiny-llama", 8, 16, 103),
    "tiny-llama-lora-r32": ("tiny-llama", 32, 64, 104),
    "tiny-wide-lora": ("tiny-wide", 8, 16, 105),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]

WORDS = """
the of and to in is it that for on was with as be at by this had not are but from or have an
they which one you were all we her she there would their will when who him been has more if
no out do so can what up said about other into than its time only could new them man some
these then two first may any like now my such make over our even most me state after also
made many did must before back see through way where get much go well your know should down
work year because come people just say each those take day good how long little own model
token cache server engine request tenant adapter memory block gateway node queue batch
prompt latency throughput console deploy scale replica health metric quota priority hello
thanks please question answer help write story code python list number value data
""".split()  # noqa: SIM905 (a list literal would be one 1,300-character line)


def log(msg: str) -> None:
    print(f"[make_tiny_model] {msg}", flush=True)


def corpus(seed: int = 0, n: int = 6000):
    rng = random.Random(seed)
    punct = [".", ".", ".", "?", "!", ",", ";", ":"]
    for i in range(n):
        k = rng.randint(4, 18)
        words = [rng.choice(WORDS) for _ in range(k)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10000)))
        if rng.random() < 0.2:
            words.insert(
                rng.randrange(len(words)), rng.choice(["{", "}", "(", ")", "=", "-", '"', "'"])
            )
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice(punct)
        if i % 7 == 0:
            s = s + "\n"
        yield s


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("</s>") == EOS_ID
    # Completions get a BOS like real Llama tokenizers; the chat template writes its own BOS and
    # vLLM renders chat prompts with add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def build_model(name: str, out: Path, tokenizer_src: Path | None) -> int:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads, inter, layers, seed = MODELS[name]
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    cfg.dtype = torch.float32
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer_src is None:
        tok_vocab = build_tokenizer(out)
    else:
        for f in sorted(tokenizer_src.iterdir()):
            if f.name.startswith("tokenizer") or f.name in (
                "special_tokens_map.json",
                "chat_template.jinja",
                "chat_template.json",
            ):
                shutil.copy2(f, out / f.name)
        tok_vocab = None
    return tok_vocab if tok_vocab is not None else -1


def build_adapter(name: str, out: Path, models_dir: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base, rank, alpha, seed = ADAPTERS[name]
    model = LlamaForCausalLM.from_pretrained(str(models_dir / base), dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,  # random A and B, so each adapter changes the output
    )
    peft_model = get_peft_model(model, cfg)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    # Record the served base name, not this machine's path; drop peft's model-card boilerplate.
    cfg_path = out / "adapter_config.json"
    acfg = json.loads(cfg_path.read_text())
    acfg["base_model_name_or_path"] = base
    acfg["target_modules"] = sorted(acfg["target_modules"])  # peft stores a set: random order
    cfg_path.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)


def dir_digest(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(d).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def dir_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def check(models_dir: Path) -> None:
    """Sanity checks with plain transformers (no vLLM): tokenizer, chat template, forward pass."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(models_dir / "tiny-llama"))
    ids = tok("Hello engine, how are you?")["input_ids"]
    assert ids[0] == BOS_ID, ids
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<s><|user|>\nhello</s>\n<|assistant|>\n", repr(prompt)
    base = LlamaForCausalLM.from_pretrained(str(models_dir / "tiny-llama"), dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = base(x).logits[0, -1]
        outs = {}
        for name in ("tiny-llama-lora-a", "tiny-llama-lora-b"):
            pm = PeftModel.from_pretrained(
                LlamaForCausalLM.from_pretrained(
                    str(models_dir / "tiny-llama"), dtype=torch.float32
                ),
                str(models_dir / name),
            )
            outs[name] = pm(x).logits[0, -1]
    for name, lg in outs.items():
        assert not torch.allclose(lg, ref), f"{name} does not change the logits"
    assert not torch.allclose(outs["tiny-llama-lora-a"], outs["tiny-llama-lora-b"])
    log(f"check ok: {len(ids)} prompt tokens, chat template ok, adapters change logits")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="regenerate even if .complete exists")
    ap.add_argument("--models-dir", default=os.environ.get("MODELS_DIR", "var/models"))
    args = ap.parse_args()

    models_dir = Path(args.models_dir)
    if not models_dir.is_absolute():
        models_dir = REPO_ROOT / models_dir
    marker = models_dir / ".complete"
    if marker.exists() and not args.force and marker.read_text().strip() == GENERATOR_VERSION:
        log(f"{models_dir} already complete ({GENERATOR_VERSION}); use --force to regenerate")
        return 0

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    random.seed(0)

    models_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)

    def fresh(name: str) -> Path:
        tmp = models_dir / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def publish(name: str, tmp: Path) -> Path:
        final = models_dir / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    tmp = fresh("tiny-llama")
    tok_vocab = build_model("tiny-llama", tmp, None)
    publish("tiny-llama", tmp)
    tmp = fresh("tiny-wide")
    build_model("tiny-wide", tmp, models_dir / "tiny-llama")
    publish("tiny-wide", tmp)
    for name in ADAPTERS:
        tmp = fresh(name)
        build_adapter(name, tmp, models_dir)
        publish(name, tmp)

    check(models_dir)

    summary = {}
    for name in list(MODELS) + list(ADAPTERS):
        d = models_dir / name
        info = {"bytes": dir_size(d), "sha256_16": dir_digest(d)}
        if name in MODELS:
            h, nh, kv, inter, layers, _ = MODELS[name]
            info.update(
                kind="model",
                hidden=h,
                heads=nh,
                kv_heads=kv,
                head_dim=h // nh,
                intermediate=inter,
                layers=layers,
                vocab=VOCAB_SIZE,
            )
        else:
            base, r, alpha, _ = ADAPTERS[name]
            info.update(kind="lora", base=base, r=r, alpha=alpha, targets=",".join(LORA_TARGETS))
        summary[name] = info
    log(
        f"tokenizer: byte-level BPE, {tok_vocab} tokens trained (model vocab {VOCAB_SIZE}), "
        f"bos <s>={BOS_ID} eos </s>={EOS_ID} pad <pad>={PAD_ID}"
    )
    for name, info in summary.items():
        rest = {k: v for k, v in info.items() if k not in ("bytes", "sha256_16")}
        log(
            f"{name:22s} {info['bytes'] / 1e6:6.2f} MB  sha256:{info['sha256_16']}  "
            + " ".join(f"{k}={v}" for k, v in rest.items())
        )
    marker.write_text(GENERATOR_VERSION + "\n")
    log(f"wrote {models_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
