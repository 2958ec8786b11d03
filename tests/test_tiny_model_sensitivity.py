"""The tiny model must make decisive greedy choices that depend on the image (issue 10).

A random tiny model's top-1 and top-2 log-probs were near-ties (median gap 0.10 nat, minimum
0.00) and its output barely depended on the image, so corrupted embeddings passed or looked like
benign drift. These tests build the checkpoint and measure, with transformers on CPU:

1. the top-1 vs top-2 log-prob margin at every greedy position of the sweep's prompts
   (median >= 1 nat, minimum >= 0.2 nat), in float32 and in bfloat16 (what vLLM serves);
2. two distinct images -> a different first generated token;
3. the same image with one 28x28 patch altered -> a different output within 4 tokens;
4. 1% Gaussian noise (relative to the merged embeddings' std) on the vision merger's output,
   i.e. what the encoder hands the LLM -> different generated tokens;
5. 5% noise on the merged embeddings of each EC-noise prompt of the graded self-test (what
   `ec-noise:0.05` plants in the EC files) -> different tokens, by generated token 2 in at
   least 90% of the trials;
6. 5% Gaussian noise (relative to each layer's K|V std) on the KV of the block-aligned prompt
   prefix that ExampleConnector hands D -> a different token by generated token 2 (the graded
   self-test's acceptance, issue 10), what `kv-noise:0.05` plants in vLLM.

Sensitivity is measured in bfloat16: it is the checkpoint's dtype and what vLLM serves, so the
figures describe the model the harness runs. Nothing here hard-codes a model output; each test
prints what it measured (`pytest -s`) and asserts thresholds.

Also: two builds are byte-identical, and `model_digest` does not depend on the
`transformers_version` that transformers stamps into the config files (issue 11).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fixtures import media, tiny_model
from harness.run import graded
from harness.spec import connectors, prompts
from harness.spec.topology import ServingConfig

pytestmark = pytest.mark.model

MIN_MEDIAN_MARGIN_NATS = 1.0
MIN_MARGIN_NATS = 0.2
PATCH_DIVERGENCE_TOKENS = 4
# At least this share of altered-patch variants must diverge within PATCH_DIVERGENCE_TOKENS.
PATCH_DETECTED_SHARE = 0.75
# At least this share of pairs of distinct images must give different first tokens; the
# sweep's own images (seeds 1, 2, 3) must all differ.
DISTINCT_PAIR_SHARE = 0.8
IMAGE_SEEDS = tuple(range(1, 9))
SWEEP_IMAGE_SEEDS = (1, 2, 3)
NOISE_RELATIVE_STD = 0.01
NOISE_SEEDS = tuple(range(5))
# The graded self-test's acceptance (issue 10): 5% of std, a different token by index 2.
NOISE_ACCEPTANCE_STD = 0.05
NOISE_ACCEPTANCE_MAX_INDEX = 2
# EC noise flips a token by index 2 at nearly every seed, not every one (measured: 19 of 20
# prompt x seed trials; the 20th at index 5); every trial must diverge.
EC_NOISE_EARLY_SHARE = 0.9
PATCH_VARIANTS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def processor(model_dir: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def _load(model_dir: Path, dtype_name: str):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.set_num_threads(1)
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=getattr(torch, dtype_name)
    ).eval()


@pytest.fixture(scope="module")
def models(model_dir: Path) -> dict:
    return {name: _load(model_dir, name) for name in ("float32", "bfloat16")}


def _decode_mp4(data: bytes) -> np.ndarray:
    import cv2

    with tempfile.NamedTemporaryFile(suffix=".mp4") as file:
        file.write(data)
        file.flush()
        capture = cv2.VideoCapture(file.name)
        frames = []
        try:
            ok, frame = capture.read()
            while ok:
                frames.append(frame[..., ::-1].copy())
                ok, frame = capture.read()
        finally:
            capture.release()
    return np.stack(frames)


def _inputs(processor, spec: prompts.PromptSpec, images: list | None = None):
    """The prompt as the model ships it: its chat template and its processor."""
    content, own_images, videos = [], [], []
    for part in spec.parts:
        if isinstance(part, prompts.TextPart):
            content.append({"type": "text", "text": part.text})
        elif isinstance(part, prompts.ImagePart):
            content.append({"type": "image"})
            own_images.append(media.make_image(part.seed, part.size))
        elif isinstance(part, prompts.VideoPart):
            content.append({"type": "video"})
            mp4 = media.video_mp4_bytes(part.seed, part.num_frames, part.fps, part.size)
            videos.append(_decode_mp4(mp4))
        else:
            raise TypeError(f"unsupported part {part!r}")
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    kwargs: dict = {}
    if images is not None or own_images:
        kwargs["images"] = images if images is not None else own_images
    if videos:
        # 8 frames at 2 fps is what the processor would sample; keep them all.
        kwargs.update(videos=videos, do_sample_frames=False)
    return processor(text=[text], return_tensors="pt", **kwargs)


def _generate(model, inputs, max_new_tokens: int, perturb=None) -> tuple[list[int], list[float]]:
    """Greedy token ids and the top-1 minus top-2 log-prob at each generated position.

    `perturb` rewrites the vision tower's merged output (what the encoder hands the LLM).
    """
    import torch

    handle = None
    if perturb is not None:

        def hook(module, args, output):
            output.pooler_output = perturb(output.pooler_output)
            return output

        handle = model.model.visual.register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
    finally:
        if handle is not None:
            handle.remove()
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    margins = []
    for logits in out.logits:
        top = torch.topk(torch.log_softmax(logits[0].float(), dim=-1), 2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_greedy_margins_are_wide(models: dict, processor, dtype_name: str) -> None:
    model = models[dtype_name]
    margins: list[float] = []
    for spec in prompts.SKELETON_PROMPTS:
        tokens, prompt_margins = _generate(model, _inputs(processor, spec), spec.max_tokens)
        print(
            f"{dtype_name} {spec.name}: {len(tokens)} tokens, margin median "
            f"{statistics.median(prompt_margins):.3f} min {min(prompt_margins):.3f}"
        )
        margins += prompt_margins
    median, minimum = statistics.median(margins), min(margins)
    print(f"{dtype_name} all {len(margins)} positions: median {median:.3f} min {minimum:.3f} nat")
    assert median >= MIN_MEDIAN_MARGIN_NATS
    assert minimum >= MIN_MARGIN_NATS


def test_distinct_images_give_distinct_first_tokens(models: dict, processor) -> None:
    model = models["bfloat16"]
    spec = prompts.SKELETON_PROMPTS[1]  # one image, then the tail text
    first = {
        seed: _generate(model, _inputs(processor, spec, [media.make_image(seed)]), 1)[0][0]
        for seed in IMAGE_SEEDS
    }
    pairs = [(a, b) for i, a in enumerate(IMAGE_SEEDS) for b in IMAGE_SEEDS[i + 1 :]]
    differing = sum(first[a] != first[b] for a, b in pairs)
    print(f"first token per image seed: {first}; {differing}/{len(pairs)} pairs differ")
    for i, a in enumerate(SWEEP_IMAGE_SEEDS):
        for b in SWEEP_IMAGE_SEEDS[i + 1 :]:
            assert first[a] != first[b], f"images {a} and {b} both start with {first[a]}"
    assert differing >= DISTINCT_PAIR_SHARE * len(pairs)


def _with_patch_inverted(image: Image.Image, row: int, col: int) -> Image.Image:
    side = tiny_model.MERGED_PATCH_SIDE_PX
    pixels = np.asarray(image).copy()
    block = pixels[row * side : (row + 1) * side, col * side : (col + 1) * side]
    pixels[row * side : (row + 1) * side, col * side : (col + 1) * side] = 255 - block
    return Image.fromarray(pixels)


def test_one_altered_patch_changes_the_output_early(models: dict, processor) -> None:
    model = models["bfloat16"]
    spec = prompts.SKELETON_PROMPTS[1]
    image = media.make_image(1)
    clean, _ = _generate(model, _inputs(processor, spec, [image]), PATCH_DIVERGENCE_TOKENS)
    grid = prompts.IMAGE_SIZE[1] // tiny_model.MERGED_PATCH_SIDE_PX
    divergences = []
    for k in range(PATCH_VARIANTS):  # spread over the 8x8 grid of 28x28 patches
        row, col = (k * 5) % grid, (k * 3 + 1) % grid
        altered = _with_patch_inverted(image, row, col)
        tokens, _ = _generate(model, _inputs(processor, spec, [altered]), PATCH_DIVERGENCE_TOKENS)
        divergences.append(_first_divergence(clean, tokens))
    detected = sum(d is not None for d in divergences)
    print(f"first divergence (token index) per altered patch: {divergences}")
    assert detected >= PATCH_DETECTED_SHARE * PATCH_VARIANTS


def _gaussian_noise(relative_std: float, seed: int):
    import torch

    def perturb(embeddings):
        generator = torch.Generator().manual_seed(seed)
        values = embeddings.float()
        noise = torch.randn(values.shape, generator=generator) * values.std() * relative_std
        return (values + noise).to(embeddings.dtype)

    return perturb


@pytest.mark.parametrize("prompt_name", ["image", "two_images", "video"])
def test_one_percent_noise_on_merged_embeddings_changes_tokens(
    models: dict, processor, prompt_name: str
) -> None:
    model = models["bfloat16"]
    spec = next(p for p in prompts.SKELETON_PROMPTS if p.name == prompt_name)
    inputs = _inputs(processor, spec)
    clean, _ = _generate(model, inputs, spec.max_tokens)
    divergences = [
        _first_divergence(
            clean,
            _generate(model, inputs, spec.max_tokens, _gaussian_noise(NOISE_RELATIVE_STD, s))[0],
        )
        for s in NOISE_SEEDS
    ]
    print(f"{prompt_name}: first divergence per noise seed: {divergences}")
    assert all(d is not None for d in divergences)


def test_five_percent_ec_noise_changes_a_token_by_index_two(models: dict, processor) -> None:
    model = models["bfloat16"]
    divergences = []
    for spec in graded.EC_NOISE_PROMPTS:
        inputs = _inputs(processor, spec)
        clean, _ = _generate(model, inputs, spec.max_tokens)
        noise = [_gaussian_noise(NOISE_ACCEPTANCE_STD, seed) for seed in NOISE_SEEDS]
        found = [
            _first_divergence(clean, _generate(model, inputs, spec.max_tokens, perturb)[0])
            for perturb in noise
        ]
        print(f"{spec.name}: first divergence per EC noise seed: {found}")
        divergences += found
    assert all(d is not None for d in divergences), divergences
    early = sum(d <= NOISE_ACCEPTANCE_MAX_INDEX for d in divergences)
    print(
        f"EC noise 5%: {early}/{len(divergences)} trials differ by token {NOISE_ACCEPTANCE_MAX_INDEX}"
    )
    assert early >= EC_NOISE_EARLY_SHARE * len(divergences)


def test_noise_hook_is_not_vacuous(models: dict, processor) -> None:
    """A zero perturbation through the same hook must reproduce the clean tokens exactly."""
    model = models["bfloat16"]
    spec = prompts.SKELETON_PROMPTS[1]
    inputs = _inputs(processor, spec)
    clean, _ = _generate(model, inputs, spec.max_tokens)
    assert _generate(model, inputs, spec.max_tokens, _gaussian_noise(0.0, 0))[0] == clean


def test_two_builds_are_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    again = tiny_model.build_tiny_model(tmp_path / "again")
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_digest_ignores_the_transformers_version_stamp(model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    stamped = []
    for path in model_dir.iterdir():
        data = path.read_bytes()
        if path.suffix == ".json" and "transformers_version" in json.loads(data):
            settings = json.loads(data)
            settings["transformers_version"] = "9.99.0"
            data = json.dumps(settings, indent=4).encode()  # another writer's layout, too
            stamped.append(path.name)
        (copy / path.name).write_bytes(data)
    assert "config.json" in stamped  # the test must actually rewrite something
    assert tiny_model.model_digest(copy) == tiny_model.model_digest(model_dir)

    # A field that matters still changes the digest.
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    assert tiny_model.model_digest(copy) != tiny_model.model_digest(model_dir)


def test_cache_key_ignores_the_transformers_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    real_version = importlib.metadata.version
    before = tiny_model.cache_key()

    def fake_version(name: str) -> str:
        return "9.99.0" if name == "transformers" else real_version(name)

    monkeypatch.setattr(tiny_model.importlib.metadata, "version", fake_version)
    assert tiny_model.cache_key() == before


def _generate_with_noisy_prefix_kv(model, inputs, max_new_tokens: int, fraction: float, seed: int):
    """Greedy tokens when the prompt's transferred KV prefix carries noise, as D would see it.

    P computes the prefix KV cleanly; the fault adds noise of `fraction` x the std of each
    layer's K and V together (one file per layer); D recomputes the tail past the last full
    block. So: record each layer's clean K/V projections of the prefix in a first pass, then
    generate with those rows replaced by clean + noise. Noise is added before RoPE here and
    after it in vLLM: isotropic Gaussian noise is unchanged in law by the rotation.
    """
    import torch

    length = inputs["input_ids"].shape[1]
    block = ServingConfig(model="unused").block_size
    prefix = connectors.expected_kv_tokens(connectors.KvRule.BLOCK_ALIGNED_PREFIX, length, block)
    projections = [
        (index, name, getattr(layer.self_attn, name))
        for index, layer in enumerate(model.model.language_model.layers)
        for name in ("k_proj", "v_proj")
    ]
    clean: dict = {}

    def record(key):
        def hook(module, args, output):
            if output.shape[1] == length:
                clean[key] = output[0, :prefix].float().clone()

        return hook

    handles = [proj.register_forward_hook(record((i, n))) for i, n, proj in projections]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    generator = torch.Generator().manual_seed(seed)
    noisy = {}
    for index in {i for i, _, _ in projections}:
        k, v = clean[(index, "k_proj")], clean[(index, "v_proj")]
        std = torch.cat([k.flatten(), v.flatten()]).std()
        for name, values in (("k_proj", k), ("v_proj", v)):
            noise = torch.randn(values.shape, generator=generator) * std * fraction
            noisy[(index, name)] = values + noise

    def replace(key):
        def hook(module, args, output):
            if output.shape[1] != length:
                return None  # a decode step: its own KV is D's, not transferred
            output = output.clone()
            output[0, :prefix] = noisy[key].to(output.dtype)
            return output

        return hook

    handles = [proj.register_forward_hook(replace((i, n))) for i, n, proj in projections]
    try:
        return _generate(model, inputs, max_new_tokens)[0], prefix
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("spec", graded.KV_NOISE_PROMPTS, ids=lambda spec: spec.name)
def test_five_percent_kv_noise_changes_a_token_by_index_two(
    models: dict, processor, spec: prompts.PromptSpec
) -> None:
    model = models["bfloat16"]
    inputs = _inputs(processor, spec)
    clean, _ = _generate(model, inputs, spec.max_tokens)
    divergences = []
    for seed in NOISE_SEEDS:
        tokens, prefix = _generate_with_noisy_prefix_kv(
            model, inputs, spec.max_tokens, NOISE_ACCEPTANCE_STD, seed
        )
        divergences.append(_first_divergence(clean, tokens))
    print(f"{spec.name}: KV prefix {prefix} tokens; first divergence per noise seed: {divergences}")
    assert prefix > 0, "the prompt is shorter than one block: nothing would be transferred"
    assert all(d is not None and d <= NOISE_ACCEPTANCE_MAX_INDEX for d in divergences), divergences


def test_kv_noise_hook_is_not_vacuous(models: dict, processor) -> None:
    """Zero KV noise through the same hooks must reproduce the clean tokens exactly."""
    model = models["bfloat16"]
    spec = graded.KV_NOISE_PROMPTS[0]
    inputs = _inputs(processor, spec)
    clean, _ = _generate(model, inputs, spec.max_tokens)
    assert _generate_with_noisy_prefix_kv(model, inputs, spec.max_tokens, 0.0, 0)[0] == clean
