"""Planted faults for the harness's self-test: each one must turn a run red with a known verdict.

A harness that cannot fail proves nothing (upstream's bash harness stayed green while every
comparison failed, vLLM failure mode 13). Each fault here breaks one link of the EPD chain on
purpose, and the self-test checks that the judge names the right verdict:

- `corrupt_ec_files`: the consumer loads wrong embeddings            -> MISMATCH
- `zero_kv_files`: D decodes from zeroed KV                          -> MISMATCH
- `drop_encoder_metadata`: raw media reach the consumer, which encodes them itself; the tokens
  still equal the baseline's, so only the transfer guards can tell   -> VACUOUS
- `drop_kv`: none of P's KV reaches D, which computes the prompt itself; the tokens still
  equal the baseline's, so only the `kv_transfer` guard can tell      -> VACUOUS
- `kill_instance`: an instance dies mid-run                          -> ERROR, at once
- `duplicate_stream_chunk`: the proxy relays the first chunk of D's stream with tokens twice:
  the client's ids differ and the stream's usage no longer counts them -> MISMATCH
- `misroute_nixl_blocks`: under NixlConnector there are no files: P's KV stays in P's memory
  and D reads it over UCX. The proxy carries P's `kv_transfer_params` to D, so the fault
  points every `remote_block_ids` entry at P's first block: D's NIXL reads P's real buffers,
  but the first block's KV into every position                       -> MISMATCH

Graded faults (issue 10) find how small a break the harness still catches, so a loss of
sensitivity shows up as a number (docs/self-test.md; the search is in `harness.run.graded`):

- `ec_noise`: seeded Gaussian noise, a given fraction of each EC tensor's std, added to the
  encoder outputs between encoder and consumer
- `kv_noise`: the same on the KV ExampleConnector files between P and D
- `nixl_kv_noise`: the same under NixlConnector, on the blocks D read from P, planted inside D by
  a vLLM plugin the harness puts on D's PYTHONPATH (`harness.run.faults.nixl_kv_noise_plugin`)
- `ec_swap_items`: the EC files of a request's media items swap places (two images: each image
  gets the other's embedding)
- `ec_zero_frame`: the rows of one temporal frame (pair) of a video's EC embedding are zeroed
- `ec_video_grid`: the consumer is told a video grid of the same size but another shape, so
  its M-RoPE positions are wrong while embeddings and prompt ids stay right (the
  `second_per_grid_ts` error itself cannot be planted from outside vLLM: see `ec_video_grid`)

Faults act only through the proxy's `ProxyFaults` hooks and on the files in the run's own
storage directories (and, for `nixl_kv_noise`, through a plugin in a directory of the run that
only a self-test's D is started with); vLLM's installed files are never touched. Only the self-tests
and an explicit `--plant-fault` use them; a normal run never does.

One module per concern, each importing only those listed before it: `spec` (the names a run
accepts, parsed), `storage_files` (the safetensors files read and replaced), `planted` (what a
fault records, and planting it on a running proxy), `tensors` (what a fault does to a tensor),
`encoded` (the items an encoders' answer reports, in either shape), `video_grid`, then the faults by
where they act: `ec_files`, `kv_files`, `relayed` (the proxy's messages), `nixl` (with
`nixl_kv_noise_plugin`, which imports nothing of the harness), `instance`; `by_name` builds any of
them from its `--plant-fault` name.
"""
