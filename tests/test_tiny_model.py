"""Tests for the tiny model checkpoint: a valid Qwen2.5-VL, cached by content, byte-identical.

They need torch and transformers (the `model` tier) and share one cached checkpoint per session,
because a build takes seconds.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from digest_reference import whole_file_digest

from fixtures import media, tiny_model
from fixtures.checkpoint_digest import model_digest

pytestmark = pytest.mark.model


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache: Path) -> Path:
    return tiny_model.ensure_tiny_model(model_cache)


def test_spec_rejects_mrope_that_does_not_fit_head_dim() -> None:
    with pytest.raises(ValueError, match="mrope_section"):
        tiny_model.TinyModelSpec(mrope_section=(4, 6, 8))


def test_cache_key_depends_on_the_spec() -> None:
    assert tiny_model.cache_key() == tiny_model.cache_key(tiny_model.TinyModelSpec())
    assert tiny_model.cache_key() != tiny_model.cache_key(tiny_model.TinyModelSpec(seed=1))


def test_ensure_reuses_the_cached_checkpoint(
    model_cache: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tiny_model_dir.parent == model_cache
    assert tiny_model_dir.name == "tiny-qwen25vl-" + tiny_model.cache_key()[:12]
    assert (tiny_model_dir / ".complete").is_file()
    digest_before = model_digest(tiny_model_dir)

    def fail_build(*args, **kwargs):
        raise AssertionError("ensure_tiny_model rebuilt a cached checkpoint")

    monkeypatch.setattr(tiny_model, "build_tiny_model", fail_build)
    assert tiny_model.ensure_tiny_model(model_cache) == tiny_model_dir
    assert model_digest(tiny_model_dir) == digest_before
    assert not list(model_cache.glob(".building-*"))


def test_ensure_replaces_an_incomplete_directory(tmp_path: Path) -> None:
    target = tmp_path / ("tiny-qwen25vl-" + tiny_model.cache_key()[:12])
    target.mkdir()
    (target / "config.json").write_text("half-written")
    (tmp_path / ".building-crashed").mkdir()

    assert tiny_model.ensure_tiny_model(tmp_path) == target
    assert (target / ".complete").is_file()
    assert (target / "config.json").read_text() != "half-written"
    assert not list(tmp_path.glob(".building-*"))


def test_concurrent_ensures_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_build = tiny_model.build_tiny_model
    builds = []

    def slow_counting_build(out_dir: Path, spec: tiny_model.TinyModelSpec) -> Path:
        builds.append(out_dir)
        time.sleep(0.5)  # widen the window in which an unlocked second caller would also build
        return real_build(out_dir, spec)

    monkeypatch.setattr(tiny_model, "build_tiny_model", slow_counting_build)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: tiny_model.ensure_tiny_model(tmp_path), range(2)))
    assert len(builds) == 1
    assert results[0] == results[1]
    assert (results[0] / ".complete").is_file()


def test_independent_builds_are_byte_identical(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Disturb every global RNG: the build must depend on the spec's seed alone.
    import torch

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    rebuilt = tiny_model.build_tiny_model(tmp_path / "rebuilt")
    assert model_digest(rebuilt) == model_digest(tiny_model_dir)


def test_model_digest_sees_names_and_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name != ".complete":
            (copy / path.name).write_bytes(path.read_bytes())
    assert model_digest(copy) == model_digest(tiny_model_dir)

    (copy / "config.json").rename(copy / "config2.json")
    assert model_digest(copy) != model_digest(tiny_model_dir)


def test_model_digest_keeps_the_value_the_caches_key_on(tiny_model_dir: Path) -> None:
    """The baseline cache and the goldens key on the digest: hashing in chunks keeps its value."""
    assert model_digest(tiny_model_dir) == whole_file_digest(tiny_model_dir)


def test_config_is_tiny_qwen25vl(tiny_model_dir: Path) -> None:
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "qwen2_5_vl"
    assert config.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    text = config.text_config
    assert text.vocab_size % 64 == 0
    assert (text.hidden_size, text.num_hidden_layers) == (128, 2)
    assert (text.num_attention_heads, text.num_key_value_heads) == (4, 2)
    assert text.rope_parameters["mrope_section"] == [4, 6, 6]
    vision = config.vision_config
    assert (vision.depth, vision.patch_size, vision.spatial_merge_size) == (2, 14, 2)
    assert vision.temporal_patch_size == 2


def test_processor_loads_and_tokenizes_an_image_prompt(tiny_model_dir: Path) -> None:
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(tiny_model_dir)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    assert len(processor.tokenizer) == config.text_config.vocab_size

    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}],
        }
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>Describe this image." in prompt
    assert prompt.endswith("<|im_start|>assistant\n")

    inputs = processor(text=[prompt], images=[media.make_image(0)], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 16, 16]]
    # 16x16 patches merge 2x2 into 64 image tokens in the prompt.
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_token_id).sum()) == 64


def test_legacy_processor_files_name_the_processor_class(tiny_model_dir: Path) -> None:
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        settings = json.loads((tiny_model_dir / name).read_text())
        assert settings["processor_class"] == "Qwen2_5_VLProcessor"
    video = json.loads((tiny_model_dir / "video_preprocessor_config.json").read_text())
    assert (video["fps"], video["min_frames"], video["max_frames"]) == (2.0, 4, 16)
    assert video["size"]["longest_edge"] == 28 * 28 * 128  # max_pixels
    image = json.loads((tiny_model_dir / "preprocessor_config.json").read_text())
    assert image["size"]["longest_edge"] == 28 * 28 * 256
