"""Test support, shared by the repository's tests and scenarios and by anyone who runs the
harness's scenarios from pytest: the pytest plugin (`plugin`: session-wide fixtures, one running
topology per (topology, connectors, proxy) for the whole session, and the helper fixtures), the
repository's test tiers (`tiers`), and one of each test helper: the fake vLLM (`fake_vllm`), the
CLI runner (`cli`), record builders (`builders`), an in-process fake instance
(`fake_instance`), process watchers (`processes`), the live topology (`live`), judging a
hand-made outcome (`judging`) and the served vLLM's parser, probed once (`served_parser`).
"""
