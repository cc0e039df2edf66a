"""A weight publish that meets a dead server: the learner's end of each HTTP channel against real servers
(subprocesses of our CPU server), one of them killed as a chaos kill would."""
import asyncio

import pytest
import torch

from april_ray.weights.broadcast import BroadcastGroup
from april_ray.weights.servers import send_to_each
from april_ray.engine.sglang_client import SGLangEngine
from april_ray.engine.sglang_server import CPUServerLauncher, ServerOptions
from april_ray.engine.weight_handoff import send_tensors
from april_ray.types import GenerateRequest, SamplingParams

MAX_LEN = 128


@pytest.fixture(scope="module")
def model(random_model_dir):
    from april_ray.model import load_policy

    return load_policy(random_model_dir)[0]


def start(model_dir, tmp_path, n: int) -> list:
    """`n` servers of the model, launched side by side and then waited for (each start is mostly one process's
    imports)."""
    servers = [CPUServerLauncher().launch(ServerOptions(str(model_dir), max_num_seqs=4, max_model_len=MAX_LEN,
                                                        log_dir=str(tmp_path / "logs"))) for _ in range(n)]
    try:
        for s in servers:
            s.wait_healthy(120)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def moved(model, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def admin(*servers) -> list[SGLangEngine]:
    """What a learner holds: each server's URL and admin key (no API key)."""
    return [SGLangEngine(s.url, admin_api_key=s.admin_api_key) for s in servers]


async def greedy(server, ids, n=6) -> list[int]:
    client = SGLangEngine(server.url, max_model_len=MAX_LEN, server=server)
    try:
        return (await client.generate(GenerateRequest("g", ids, SamplingParams(0.0, max_new_tokens=n)))).token_ids
    finally:
        await client.close()


def reference(model, sd, ids, n=6) -> list[int]:
    clone = type(model)(model.config).eval()
    clone.load_state_dict(sd)
    out = clone.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_a_broadcast_leaves_a_dead_server_out_and_a_rebuilt_group_takes_its_successor_in(
        random_model_dir, model, tmp_path):
    ids = [5, 6, 7, 8]
    a, b = start(random_model_dir, tmp_path, 2)
    c = None
    sender = BroadcastGroup("127.0.0.1", "gloo", bucket_mb=0.05)  # several buckets
    try:
        async def main():
            nonlocal c
            first, second = moved(model, 1), moved(model, 2)
            assert await sender.send(admin(a, b), list(first.items()), 1, True) == [a.url, b.url]
            b.proc.kill()  # its engine died: the next publish leaves it out and goes on
            b.proc.wait()
            assert await sender.send(admin(a, b), list(second.items()), 2, True) == [a.url]
            [c] = start(random_model_dir, tmp_path, 1)  # the restarted engine's new server
            assert await sender.send(admin(a, c), list(second.items()), 2, True) == [a.url, c.url]
            return await greedy(a, ids), await greedy(c, ids), second
        out_a, out_c, second = asyncio.run(main())
        assert out_a == out_c == reference(model, second, ids)
    finally:
        for s in (a, b, c):
            if s is not None:
                s.stop()


class DiesMidBroadcast(SGLangEngine):
    """The client of a server that is SIGKILLed as its first bucket is announced, as a chaos kill can land:
    the group's other members are inside that bucket's broadcast, and rank 0's send to it (rank 1: it
    receives first) fails on the reset connection, before the tensors went on to the others."""

    def __init__(self, server):
        super().__init__(server.url, admin_api_key=server.admin_api_key)
        self.proc, self.buckets = server.proc, 0

    async def update_weights_from_distributed(self, *args, **kwargs) -> None:
        self.buckets += 1
        if self.buckets == 1:
            self.proc.kill()
            self.proc.wait()
        await super().update_weights_from_distributed(*args, **kwargs)


@pytest.mark.timeout(300)  # a survivor left waiting for the broadcast runs into the group's hour-long timeout
def test_a_server_killed_mid_broadcast_leaves_the_others_free_at_once(random_model_dir, model, tmp_path):
    """The sender's end of the broken group closes at once, so the surviving server's receive fails instead
    of waiting out the group's timeout (the publish, and every engine paused by it, waited with it)."""
    ids = [5, 6, 7, 8]
    a, b = start(random_model_dir, tmp_path, 2)
    # one bucket of tensors of megabytes: more than a socket's buffer, so the dead peer's reset is seen
    sender = BroadcastGroup("127.0.0.1", "gloo", bucket_mb=64, timeout_s=3600)
    try:
        async def main():
            weights = moved(model, 3)
            loaded = await sender.send([DiesMidBroadcast(b), *admin(a)], list(weights.items()), 1, True)
            return loaded, await greedy(a, ids), weights
        loaded, out_a, weights = asyncio.run(main())
        assert loaded == [a.url]  # regrouped with the survivor, which loaded the whole publish
        assert out_a == reference(model, weights, ids)
    finally:
        for s in (a, b):
            s.stop()


def test_a_handoff_or_disk_load_to_a_dead_server_leaves_it_out(random_model_dir, model, tmp_path):
    a, b = start(random_model_dir, tmp_path, 2)
    try:
        b.proc.kill()
        b.proc.wait()
        sd = moved(model, 3)

        async def main():
            handed = await send_to_each(admin(a, b), lambda c: send_tensors(
                c, list(sd.items()), 3, True, bucket_mb=1))
            loaded = await send_to_each(admin(a, b), lambda c: c.update_weights_from_disk(
                str(random_model_dir), True, 4))
            return handed, loaded
        assert asyncio.run(main()) == ([a.url], [a.url])
    finally:
        a.stop()
        b.stop()


def test_the_object_store_channel_puts_each_tensors_own_bytes_not_the_buffer_it_views():
    """Parameters that are views of one flat buffer (a CPU DeepSpeed learner's) go into the object store
    as their own bytes: a view would carry the whole buffer with it, once per tensor."""
    import pickle

    from april_ray.weights.object_store import ObjectStoreSender

    flat = torch.arange(4000, dtype=torch.float32)
    named = [(f"layer{i}.weight", flat[i * 1000:(i + 1) * 1000].view(10, 100)) for i in range(4)]
    put = ObjectStoreSender(0, put=lambda obj: obj).send(named, [], version=1).weights
    assert list(put) == [n for n, _ in named]
    for (_, view), sent in zip(named, put.values()):
        assert torch.equal(sent, view) and sent.untyped_storage().nbytes() == view.numel() * 4
    assert len(pickle.dumps(put)) < 2 * flat.numel() * 4  # about the weights' 16 kB, not 4 x 16 kB
    flat.zero_()  # a copy: the learner's next step does not change what the engines adopt
    assert put["layer1.weight"][0, 0] == 1000
    assert ObjectStoreSender(1, put=lambda obj: obj).send(named, [], 1).weights is None  # rank 0 alone puts
