"""A weight update is all or nothing, on every channel: an update whose last bucket holds a NaN is refused,
naming the tensor, and the engine keeps serving the weights it had, bit for bit (every parameter compared
with torch.equal, and a greedy generation's tokens), under the version it had; the next good update still
applies, whole. The in-actor engine takes the object store's weights; our CPU server (a real subprocess)
takes them by broadcast over gloo, by shared-memory handles, from disk, and from an HTTP engine's object
store handoff."""
import asyncio

import pytest
import torch

from april_ray.engine.base import BadRequestError
from april_ray.engine.sglang_client import SGLangEngine
from april_ray.engine.sglang_server import CPUServerLauncher, ServerOptions
from april_ray.engine.weight_handoff import send_tensors, weight_update
from april_ray.engine.weight_sync import buckets, serialize_named_tensors
from april_ray.types import GenerateRequest, SamplingParams
from april_ray.weights.broadcast import BroadcastGroup
from april_ray.weights.disk import save_for_disk_update
from april_ray.weights.object_store import ObjectStoreSender

MAX_LEN = 128
BUCKET_MB = 0.1
PROMPT = [5, 6, 7, 8]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model(random_model_dir):
    from april_ray.model import load_policy

    return load_policy(random_model_dir)[0]


def served(model, seed: int, nan: bool = False) -> list[tuple[str, torch.Tensor]]:
    """New weights as a learner sends them (a tied head by the embedding alone), in state-dict order, so the
    last tensor travels in the last bucket; `nan`: that tensor holds one NaN."""
    g = torch.Generator().manual_seed(seed)
    named = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]
    if nan:
        named[-1][1].view(-1)[0] = float("nan")
    return named


def reference(model, named, n=NEW_TOKENS) -> list[int]:
    clone = type(model)(model.config).eval()
    clone.load_state_dict(dict(named), strict=False)
    clone.tie_weights()
    out = clone.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


def test_the_updates_span_several_buckets_and_the_nan_is_in_the_last(model):
    parts = buckets(served(model, 1, nan=True), int(BUCKET_MB * (1 << 20)))
    assert len(parts) >= 3
    assert not torch.isfinite(parts[-1][-1][1]).all() and all(torch.isfinite(t).all() for p in parts[:-1] for _, t in p)


# -- the in-actor engine: the object store's weights --------------------------------------------------------

def engine_greedy(engine, rid: str):
    out = engine.generate([GenerateRequest(rid, PROMPT, SamplingParams(0.0, max_new_tokens=NEW_TOKENS))])
    return out[0].token_ids, out[0].versions


@pytest.mark.parametrize("bad", ["nan", "shape"])
def test_the_in_actor_engine_keeps_its_weights_when_the_last_tensor_is_refused(random_model_dir, bad):
    """Through the object-store sender into the engine's `update_weights` (what the engine actor calls): a
    NaN, or a wrong shape, in the last tensor is refused by name before any tensor is copied."""
    from april_ray.engine.async_engine import AsyncEngine
    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.model import load_policy

    model = load_policy(random_model_dir)[0]
    engine = AsyncEngine(LLMEngine(model, max_num_seqs=4, max_model_len=MAX_LEN, version=3))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    tokens, versions = engine_greedy(engine.engine, "before")
    put = ObjectStoreSender(0, put=lambda obj: obj)
    named = served(model, 1, nan=bad == "nan")
    last = named[-1][0]
    if bad == "shape":
        named[-1] = (last, torch.zeros(3))
    with pytest.raises(ValueError, match=f"weight '{last}'" if bad == "nan" else "does not match") as refused:
        engine.update_weights(put.send(named, [], 4).weights, 4)
    assert last in str(refused.value)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert engine.engine.version == 3 and engine.stats().version == 3
    assert engine_greedy(engine.engine, "after") == (tokens, versions) and versions == [3] * NEW_TOKENS

    good = served(model, 2)
    engine.update_weights(put.send(good, [], 4).weights, 4)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in good) and engine.engine.version == 4
    assert engine_greedy(engine.engine, "good") == (reference(model, good), [4] * NEW_TOKENS)


# -- our CPU server: broadcast, tensor handles, disk, an HTTP engine's object-store handoff ----------------

@pytest.fixture(scope="module")
def server(random_model_dir, tmp_path_factory):
    opts = ServerOptions(str(random_model_dir), max_num_seqs=4, max_model_len=MAX_LEN, startup_timeout_s=120,
                         log_dir=str(tmp_path_factory.mktemp("logs")),
                         weights_root=str(tmp_path_factory.getbasetemp()), admin_api_key="-admin-key")
    srv = CPUServerLauncher().start(opts)
    yield srv
    srv.stop()


async def served_state(client, names) -> dict[str, torch.Tensor]:
    """Every tensor the server serves, read back whole (`/get_weights_by_name`)."""
    return {n: torch.tensor(await client.request("POST", "/get_weights_by_name", {"name": n, "truncate_size": 1 << 20}))
            for n in names}


async def serving(client, names, rid: str):
    """(every served tensor, a greedy generation's tokens and versions, the reported weight version)."""
    out = await client.generate(GenerateRequest(rid, PROMPT, SamplingParams(0.0, max_new_tokens=NEW_TOKENS)))
    info = await client.model_info()
    return await served_state(client, names), out.token_ids, out.versions, info["weight_version"]


async def deliver(how: str, client, named, version: int, tmp_path, group: BroadcastGroup) -> None:
    if how == "broadcast":
        await group.send([client], named, version, flush_cache=True)
    elif how == "tensor":
        await send_tensors(client, named, version, flush_cache=True, bucket_mb=BUCKET_MB)
    elif how == "disk":
        out = tmp_path / f"v{version}"
        save_for_disk_update(named, str(out), str(tmp_path.parent))  # no config files needed by our server
        await client.update_weights_from_disk(str(out), flush_cache=True, weight_version=version)
    else:  # an HTTP engine adopting the object store's weights hands them to its server (engine.update_weights)
        weights = ObjectStoreSender(0, put=lambda obj: obj).send(named, [], version).weights
        await asyncio.to_thread(client.update_weights, weights, version)


@pytest.mark.parametrize("how", ["broadcast", "tensor", "disk", "object_store"])
def test_a_server_keeps_its_weights_and_version_when_the_last_bucket_holds_a_nan(server, model, how, tmp_path):
    names = list(model.state_dict())
    bad, good = served(model, 10, nan=True), served(model, 11)
    version = {"broadcast": 21, "tensor": 22, "disk": 23, "object_store": 24}[how]

    async def main():
        client = SGLangEngine(server.url, max_model_len=MAX_LEN, server=server, admin_api_key=server.admin_api_key,
                              bucket_mb=BUCKET_MB)
        group = BroadcastGroup("127.0.0.1", "gloo", bucket_mb=BUCKET_MB, timeout_s=60)
        try:
            before = await serving(client, names, "before")
            with pytest.raises(BadRequestError, match="NaN or infinite") as refused:
                await deliver(how, client, bad, version, tmp_path, group)
            after = await serving(client, names, "after")
            await deliver(how, client, good, version, tmp_path, group)
            return before, str(refused.value), after, await serving(client, names, "good")
        finally:
            await group.close()
            await client.close()

    before, refused, after, updated = asyncio.run(main())
    assert repr(bad[-1][0]) in refused  # the refusal names the tensor
    assert before[0].keys() == after[0].keys() == set(names)
    assert all(torch.equal(before[0][n], after[0][n]) for n in names)  # bit for bit
    assert after[1:] == before[1:] and before[3] != str(version)  # the same tokens, under the old version
    assert all(torch.equal(updated[0][n], t) for n, t in good)
    assert updated[1] == reference(model, good) and updated[3] == str(version)
    assert updated[2] == [version] * NEW_TOKENS


def test_an_update_whose_sender_stops_before_the_last_bucket_is_dropped(server, model):
    """A sender that fails after some buckets (another server of its group died, say) ends the session
    without the bucket that names the version: what the server staged is dropped, none of it loaded."""
    names = list(model.state_dict())
    named = served(model, 12)

    async def main():
        client = SGLangEngine(server.url, max_model_len=MAX_LEN, server=server, admin_api_key=server.admin_api_key)
        try:
            before = await serving(client, names, "before")
            with pytest.raises(RuntimeError, match="the sender failed"):
                async with weight_update([client]):
                    for bucket in buckets(named, int(BUCKET_MB * (1 << 20)))[:-1]:
                        payload, keep = serialize_named_tensors(bucket)
                        await client.update_weights_from_tensor([payload], flush_cache=True)
                        del keep
                    raise RuntimeError("the sender failed")
            return before, await serving(client, names, "after")
        finally:
            await client.close()

    before, after = asyncio.run(main())
    assert all(torch.equal(before[0][n], after[0][n]) for n in names)
    assert after[1:] == before[1:]


@pytest.mark.parametrize("channel", ["object_store", "disk"])
def test_a_learner_rank_sends_no_byte_of_weights_that_hold_a_nan(model, channel, tmp_path):
    """Real SGLang loads each bucket as it comes and checks none: every channel's sender refuses such weights,
    naming the tensor, before anything leaves the rank (no object put, no file written, no server called)."""
    from april_ray.weights import build_sender

    puts = []
    sender = build_sender(channel, 0, 1, flush_cache=True, bucket_mb=BUCKET_MB, disk_path=str(tmp_path / "w"),
                          base_model_dir=str(tmp_path), put=puts.append)
    bad = served(model, 13, nan=True)
    with pytest.raises(ValueError, match=f"weight {bad[-1][0]!r} holds NaN"):
        sender.send(bad, [], 5)
    assert puts == [] and not (tmp_path / "w").exists()
    assert sender.send(served(model, 14), [], 5) is not None and (puts or (tmp_path / "w" / "model.safetensors").exists())
