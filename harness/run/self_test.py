"""The self-test's prompts: the sweep's shapes (one image, two images, a video), each with media
of its own, so a fault planted on one request's files never reaches another request - nor a
sweep case served later on the same running topology (the topology pool shares it).
"""

from __future__ import annotations

from harness.spec.prompts import TAIL_TEXT, ImagePart, PromptSpec, TextPart, VideoPart

CLEAN_PROMPT = PromptSpec("st-image", (ImagePart(seed=61), TextPart(TAIL_TEXT)))
CORRUPT_EC_PROMPT = PromptSpec(
    "st-two-images", (ImagePart(seed=62), ImagePart(seed=63), TextPart(TAIL_TEXT))
)
DROP_METADATA_PROMPT = PromptSpec("st-video", (VideoPart(seed=64), TextPart(TAIL_TEXT)))
ZERO_KV_PROMPT = PromptSpec(
    "st-two-images-kv", (ImagePart(seed=65), ImagePart(seed=66), TextPart(TAIL_TEXT))
)
# D computes this prompt itself: none of P's KV reaches it (the planted `drop-kv`).
DROP_KV_PROMPT = PromptSpec("st-image-kv", (ImagePart(seed=68), TextPart(TAIL_TEXT)))
# The killed instance fails a request whose media nothing else uses.
AFTER_KILL_PROMPT = PromptSpec("st-after-kill", (ImagePart(seed=67), TextPart(TAIL_TEXT)))
SELF_TEST_PROMPTS = (
    CLEAN_PROMPT,
    CORRUPT_EC_PROMPT,
    DROP_METADATA_PROMPT,
    ZERO_KV_PROMPT,
    DROP_KV_PROMPT,
    AFTER_KILL_PROMPT,
)
