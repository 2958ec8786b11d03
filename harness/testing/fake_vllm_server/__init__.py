"""The fake vLLM's server: a `vllm serve` look-alike, standard library only.

`harness.testing.fake_vllm` writes its entry module (`serve`) behind a `#!` line as an
executable named `vllm`, and every other module of this package beside it, with
harness/spec/video_sampling.py: where the executable runs (an export's run.sh) the harness may
not be importable, so each module imports its siblings as plain modules there, and as this
package's modules only when the unit tests of its pure functions import it. The harness never
imports it. See `harness.testing.fake_vllm` for the flags it reads and the misbehaviours it
plays on cue. One concern a module, each importing only the ones above it here:

- `failures`: how a request fails, as vLLM answers it;
- `tensors`: the connectors' safetensors files, written and read without torch;
- `video_timing`: the frames of a raw video and the rate they stand for;
- `media`: one media item of a request, its embedding and its placeholders;
- `model`: a prompt's ids, its KV rows and the ids generated from them;
- `sse`: an answer as the server-sent events vLLM streams;
- `engine`: what one instance knows and counts, and how it moves EC and KV;
- `handlers`: the HTTP API and NIXL's side channel;
- `serve`: the command line, the modes, the start.

Why it computes anything at all: the transfer guards (`harness.judge.guards`) must be able to
hold or fail on a fake topology for the reasons they do on a real one, so the fake moves its
evidence the way vLLM 0.32 does, and only when its peer really handed it over:

- a prompt is tokenized into a realistic number of ids (a chat template, one id per word, a
  run of placeholder ids per media item sized by its grid), more than a block;
- each media item has an "embedding" (rows of float32 derived from the media source). The
  encoder writes it where ECExampleConnector does (`<ec storage>/<mm_hash>/
  encoder_cache.safetensors`, tensor `ec_cache`) and answers `ec_transfer_params`
  `{mm_hash: {"item_indices": [...], "metadata": {grid}}}`; a consumer given a metadata-only
  `*_embeds` part loads that file (none there: the request fails), and one given raw media
  computes the embedding itself (vLLM's silent fallback);
- each prompt position has a "KV" row chained from the previous row, its token and its
  embedding row (a video's row also from its temporal position, below), and the generated ids
  are a digest of every row: a changed embedding, position or KV row changes the answer, as it
  would a model's;
- a video's temporal steps sit where Qwen2.5-VL puts them (`iter_mm_grid_thw`): step t at
  `int(t * second_per_grid_ts * tokens_per_second)`. Given the media, an instance derives
  `second_per_grid_ts` as the processor does, `temporal_patch_size / fps`, where fps is the
  rate of the frames vLLM 0.32's loaders keep (harness/spec/video_sampling.py). JPEG frames:
  the first `num_frames` (default 32) at the request's `media_io_kwargs` video fps, else 1; an
  mp4: the frame count and rate its header gives (what OpenCV reports to vLLM's loader),
  sampled as Qwen2VLVideoBackend samples them. Given a metadata-only `video_embeds` part an
  instance has only the grid the encoder published and assumes 1.0, as vLLM 0.32's consumer
  does. So JPEG frames at the default fps, or an mp4 recorded at 1 fps, through an encoder
  mismatch; at 2 fps (or an mp4 sampled down to it) they match (the video-timing bug of
  docs/found-in-vllm.md). A video's grid has one temporal step per two frames kept;
- ExampleConnector: P writes the rows of the block-aligned prefix to `<kv storage>/<prompt
  hash>/<layer>.safetensors` (tensor `kv_cache`); D loads them if that directory exists, and
  reports them as `cached_tokens` and in its `/metrics` (`external_unspecified`);
- NixlConnector: P keeps its rows in blocks in its memory and answers the
  `kv_transfer_params` vLLM's NIXL P does (block ids, its side channel host and port); D,
  handed those, reads the blocks from P's side channel (a small HTTP server on
  `VLLM_NIXL_SIDE_CHANNEL_PORT`) and counts them as `p2p` in its `/metrics` with NIXL's
  transfer counters, reporting `cached_tokens=0` as vLLM 0.32 does. Without them (a proxy that
  skipped P, or withheld its answer) D computes the prompt itself and counts it as
  `local_compute`.

The metric names are vLLM 0.32's (`vllm/v1/metrics/loggers.py`, `.../nixl/stats.py`). There is
no prefix cache unless the mode `prefix-cache` asks for one: then an instance keeps the rows of
every prompt's full blocks under the request's `cache_salt`, and a later request with the same
blocks and salt takes them from there (`cached_tokens`, `local_cache_hit` in its `/metrics`)
without asking its connector, as vLLM's D does with a prompt it has seen.
"""
