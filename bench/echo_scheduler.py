"""A stand-in scheduler that answers every request at once with N fixed tokens.

A test double for the frontend benchmark only (it never runs in `surge serve`): it isolates the
frontend's own cost (parse, tokenize, enqueue, detokenize, SSE framing) from the model's.
"""

from __future__ import annotations

import msgspec
import zmq

from surge.protocol import (
    EngineOutputs,
    EngineReady,
    EngineRequest,
    FrontendMessage,
    RequestOutput,
    encode,
)
from surge.runtime import Channels

TOKENS = [9690, 28, 905, 30, 1, 2]  # arbitrary ids; the last is never a stop token here


def run_echo_scheduler(channels: Channels, num_tokens: int) -> None:
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    requests.bind(channels.requests)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(channels.outputs)
    outputs.send(encode(EngineReady(num_blocks=100_000, block_size=16, description="echo")))
    decoder = msgspec.msgpack.Decoder(FrontendMessage)
    tokens = [TOKENS[i % 4] for i in range(num_tokens)]
    while True:
        msg = decoder.decode(requests.recv())
        if not isinstance(msg, EngineRequest):
            continue
        rid = msg.request_id
        # The acknowledgement the real scheduler sends on admission, then the tokens.
        outs = [RequestOutput(rid, []), *(RequestOutput(rid, [t]) for t in tokens[:-1])]
        outs.append(RequestOutput(rid, [tokens[-1]], "length"))
        outputs.send(encode(EngineOutputs(outs)))
