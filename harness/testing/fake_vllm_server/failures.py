"""How a request to the fake fails, as vLLM answers it: an engine that cannot serve it (500), a
frontend that refuses it (400), or an engine core that dies of it. Every other module raises
these and only the HTTP handlers (`handlers`) turn them into answers, so they sit at the bottom.
"""

from __future__ import annotations

# EngineDeadError's message (vllm/v1/engine/exceptions.py): what a request gets as its core dies.
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class RequestFailed(Exception):
    """What vLLM would answer with an HTTP error (its engine could not serve the request)."""


class RequestRejected(Exception):
    """What vLLM's frontend refuses before the engine sees it: HTTP 400, `param` named
    (VLLMValidationError, vllm/exceptions.py; its message as `str()` gives it)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{message} (parameter={param})")
        self.param = param


class EmbeddingsMissing(RequestFailed):
    """An item with neither embeddings nor media to encode reached the engine: in vLLM 0.32 the
    worker's sanity check asserts (vllm/v1/worker/utils.py, `sanity_check_mm_encoder_outputs`)
    and the engine core dies, taking its API server down after the request's error (a 500,
    or, streamed, an error event after the 200: `sse.engine_dead_events`)."""

    def __init__(self, detail: str):
        super().__init__(
            "AssertionError: Expected number of multimodal embeddings to match number of input "
            "items: 1, but got len(mm_embeddings)=0 instead. This is most likely due to "
            f"incorrect implementation of the model's `embed_multimodal` method. ({detail})"
        )
