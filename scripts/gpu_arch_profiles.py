"""Start vLLM once per architecture shape on a GPU host and keep its raw start-up log.

    PYTHONPATH=SITE python3 scripts/gpu_arch_profiles.py OUT_DIR SHAPE [SHAPE ...]

Each shape is a public model's ``config.json`` (tests/placement/fixtures/configs) served with
random weights of its real shape (``load_format="dummy"``, no tokenizer:
``skip_tokenizer_init``) at the settings of issue 41's runs: bf16, ``max_model_len`` 8192,
``max_num_seqs`` 256, 8,192 batched tokens, ``gpu_memory_utilization`` 0.90. A shape ending in
``-fp8`` serves the config with ``--quantization fp8 --kv-cache-dtype fp8``. A shape ending in
``-w4a16`` is the pre-quantized layout: the config with a compressed-tensors ``quantization_config``
(4-bit integer weights packed in int32, symmetric, groups of 128, the LM head left in bf16: what
``llm-compressor``'s W4A16 scheme writes), built in the engine's own process so that the
parameters vLLM's quantized layers create (``CompressedTensorsWNA16.create_weights``: names,
dtypes, shapes, before any repacking for the kernel) are dumped as a safetensors header to
``OUT_DIR/<shape>.header.json``: the header a checkpoint of that layout has (vLLM's fused names,
``qkv_proj`` for ``q_proj``/``k_proj``/``v_proj``; the same bytes). Each engine runs in
its own process, which exits once the engine is built (its KV cache sized, its graphs captured);
``OUT_DIR/<shape>.log`` holds everything it logged (keep them under
docs/gpu-runs/<date>-<card>-planner/); its memory split line is what
``engine.startup.StartupProgress`` reads. Runs in the engine's interpreter (Python 3.12, the
packed vLLM 0.26: ../shared/gpu/pack.sh); imports nothing of the console.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "placement" / "fixtures" / "configs"
ENGINE = """
import json, os, sys
fp8 = sys.argv[2] == "1"
header_out = sys.argv[3] if len(sys.argv) > 3 else ""
if header_out:  # the model is built in this process; its parameters dumped before loading
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm.model_executor.model_loader import base_loader
    NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
             torch.float8_e5m2: "F8_E5M2"}
    inspect = base_loader.log_model_inspection

    def dump(model):
        header, offset = {}, 0
        for name, param in model.named_parameters():
            size = param.numel() * param.element_size()
            header[name] = {"dtype": NAMES[param.dtype], "shape": list(param.shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        with open(header_out, "w") as handle:
            json.dump(header, handle, indent=0)
        print(f"HEADER DUMPED {len(header)} tensors {offset} bytes", flush=True)
        inspect(model)

    base_loader.log_model_inspection = dump
from vllm import LLM
LLM(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
    max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=8192,
    gpu_memory_utilization=0.90, quantization="fp8" if fp8 else None,
    kv_cache_dtype="fp8" if fp8 else "auto", trust_remote_code=False)
print("ENGINE BUILT", flush=True)
"""
# What llm-compressor's W4A16 scheme writes into a checkpoint's config.json (the planner's test
# reads the same file).
W4A16 = json.loads((CONFIGS.parent / "quantization" / "w4a16.json").read_text())
# NVLink multicast off in every process (ENGINE.md, "GPUs").
QUIET = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
         "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}


def run_shape(shape: str, out: Path, timeout: int) -> None:
    fp8, w4a16 = shape.endswith("-fp8"), shape.endswith("-w4a16")
    base = shape.removesuffix("-fp8").removesuffix("-w4a16")
    config = json.loads((CONFIGS / f"{base}.json").read_text())
    if w4a16:
        config["quantization_config"] = W4A16
    folder = Path("/tmp/shapes") / shape
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    log = out / f"{shape}.log"
    started = time.monotonic()
    with log.open("w") as handle:
        handle.write(f"# {shape}: vLLM dummy weights, bf16, max_model_len 8192, max_num_seqs 256,"
                     f" 8192 batched tokens, gpu_memory_utilization 0.90, fp8 {fp8},"
                     f" compressed-tensors W4A16 {w4a16}\n")
        handle.flush()
        header = [str(out / f"{shape}.header.json")] if w4a16 else []
        try:
            code = subprocess.run(
                [sys.executable, "-c", ENGINE, str(folder), "1" if fp8 else "0", *header],
                stdout=handle, stderr=subprocess.STDOUT, timeout=timeout,
                env={**os.environ, **QUIET}).returncode
        except subprocess.TimeoutExpired:
            code = -1
        handle.write(f"# exit {code} after {time.monotonic() - started:.0f} s\n")
    print(f"{shape}: exit {code} in {time.monotonic() - started:.0f} s", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    timeout = int(os.environ.get("SHAPE_TIMEOUT", "290"))
    for shape in sys.argv[2:]:
        run_shape(shape, out, timeout)


if __name__ == "__main__":
    main()
