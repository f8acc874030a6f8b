# Sourced by setup_console.sh and setup_engine.sh: `uv_pip VENV ARGS...` runs `uv pip ARGS...`
# against the virtualenv VENV, from the package sources pip is configured with here (its
# find-links, index and extra indexes, constraints: `pip config list`), resolving as pip does
# (best version across all of them). uv installs the same packages as pip (checked with
# `pip freeze` on 2026-12-05) about ten times faster: pip took 120 s for the console's and
# 150-170 s for the engine's, uv 12 s and 40 s with an empty cache (docs/testing.md).
#
# uv comes from PyPI into the venv itself (`pip install uv`); where it cannot be had, `uv_pip`
# falls back to pip with the same arguments.

uv_pip() {
    local venv="$1"; shift
    if [[ ! -x "${venv}/bin/uv" ]]; then
        "${venv}/bin/python" -m pip install --quiet uv 2>&1 | { grep -v "^WARNING: Location" || true; }
    fi
    if [[ ! -x "${venv}/bin/uv" ]]; then
        echo "[uv_pip] uv not installable: pip instead"
        if [[ "$1" == "uninstall" ]]; then
            "${venv}/bin/python" -m pip "$@" --yes
        else
            "${venv}/bin/python" -m pip "$@"
        fi
        return
    fi
    local sources=() key value
    while IFS='=' read -r key value; do
        value="${value#\'}"; value="${value%\'}"
        case "${key##*.}" in
            find-links) for v in $value; do sources+=(--find-links "$v"); done ;;
            index-url) sources+=(--index-url "$value") ;;
            extra-index-url) for v in $value; do sources+=(--extra-index-url "$v"); done ;;
            constraint) for v in $value; do sources+=(--constraint "$v"); done ;;
        esac
    done < <("${venv}/bin/python" -m pip config list 2>/dev/null)
    local command="$1"; shift
    if [[ "$command" == "uninstall" ]]; then
        "${venv}/bin/uv" pip uninstall --python "${venv}/bin/python" "$@"
    else
        "${venv}/bin/uv" pip "$command" --python "${venv}/bin/python" --index-strategy unsafe-best-match \
            "${sources[@]}" "$@"
    fi
}
