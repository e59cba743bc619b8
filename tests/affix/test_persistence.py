"""The affix cache on disk (acache.affix.persistence): round trips, refusals of what cannot be trusted,
and recovery that sets faults aside and loads the rest."""

from __future__ import annotations

import json
import os

import pytest
import torch

from acache import GEN, LLM, Affix, SamplingParams
from acache.affix.persistence import AffixDirectory, AffixStoreError, LoadReport, _checksum
from acache.affix.store import AffixStore
from tests.conftest import tiny_checkpoint


@pytest.fixture(scope="module")
def model(llada_dir):
    from acache.models.loader import load_model

    return load_model(llada_dir)


def test_save_load_round_trip_gives_identical_generations(tmp_path, llada_dir):
    story = Affix("Mary moved to the kitchen. John went to the garden. Mary took the apple. ", name="story")
    prompts = [[story, "Where is Mary?", GEN], ["Where is John? ", story, "Answer:", GEN]]
    params = SamplingParams(gen_length=16, block_length=8, threshold=0.5, selector="attention")
    first = LLM(llada_dir)
    want = first.generate(prompts, params, use_tqdm=False)
    saved = first.save_affix_cache(tmp_path / "cache")
    manifest = json.loads((saved / "manifest.json").read_text())
    assert len(manifest["entries"]) == 1 and manifest["entries"][0]["name"] == "story"
    restarted = LLM(llada_dir, affix_cache_dir=tmp_path / "cache")
    assert len(restarted.engine.affixes) == 1
    got = restarted.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.stats.affix.affix_hits == 1 and o.stats.affix.affix_misses == 0 for o in got)
    stored = restarted.engine.affixes.entries[manifest["entries"][0]["key"]].entry(restarted.engine.pool)
    original = first.engine.affixes.entries[manifest["entries"][0]["key"]].entry(first.engine.pool)
    assert all((a == b).all() for a, b in zip(stored.keys, original.keys, strict=True))


def test_loading_a_cache_of_another_model_is_refused(tmp_path, model):
    store = AffixStore(model)
    store.acquire([1, 2, 3])
    store.save(tmp_path / "cache")
    other = tiny_checkpoint(tmp_path / "other", "llada", seed=2)
    from acache.models.loader import load_model

    with pytest.raises(ValueError, match="was made with another model"):
        AffixStore(load_model(other)).load(tmp_path / "cache")
    with pytest.raises(AffixStoreError, match="no affix cache"):
        AffixStore(model).load(tmp_path / "nothing")


# -- a store on disk that cannot be trusted ---------------------------------------------------------


def saved_store(model, root, *affixes):
    store = AffixStore(model)
    for ids in affixes:
        store.acquire(ids)
    store.save(root)
    return json.loads((root / "manifest.json").read_text())


def rewrite(root, change, fix_checksums=True):
    """Applies ``change(tensors, manifest)`` to a saved cache; by default re-signs the checksums, as a
    careful forger would, so that only the deeper checks can catch it."""
    from safetensors.torch import load_file, save_file

    manifest = json.loads((root / "manifest.json").read_text())
    tensors = dict(load_file(root / manifest["tensors"]))
    change(tensors, manifest)
    if fix_checksums:
        for item in manifest["entries"]:
            item["sha256"] = _checksum({n: t for n, t in tensors.items() if n.startswith(item["key"] + ".")})
    save_file(tensors, root / manifest["tensors"])
    (root / "manifest.json").write_text(json.dumps(manifest))


A, B = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]


def swap(tensors, manifest):
    ka, kb = (e["key"] for e in manifest["entries"])
    for name in [n for n in tensors if n.startswith(ka)]:
        other = kb + name[len(ka):]
        tensors[name], tensors[other] = tensors[other], tensors[name]


def nan(tensors, manifest):
    name = next(n for n in tensors if n.endswith(".v.1"))
    tensors[name] = tensors[name].clone().fill_(float("nan"))


def short(tensors, manifest):
    name = next(n for n in tensors if n.endswith(".k.1"))
    tensors[name] = tensors[name][:-1].clone()


def altered(tensors, manifest):
    name = next(n for n in tensors if n.endswith(".k.1"))
    tensors[name] = tensors[name] + 1.0


@pytest.mark.parametrize("change, fix, message", [
    (swap, True, "were not computed from its tokens by this model"),
    (swap, False, "do not match their checksum"),
    (nan, True, "NaN or infinite"),
    (short, True, "has shape"),
    (altered, False, "do not match their checksum"),
], ids=["swapped-resigned", "swapped", "nan", "wrong-shape", "altered"])
def test_a_forged_or_corrupt_entry_is_refused_before_any_page_is_taken(model, tmp_path, change, fix, message):
    from acache.engine import EngineConfig, LLMEngine

    saved_store(model, tmp_path, A, B)
    rewrite(tmp_path, change, fix)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 20))
    with pytest.raises(AffixStoreError, match=message) as err:
        engine.affixes.load(tmp_path)
    assert str(tmp_path) in str(err.value)
    assert engine.pool.num_used == 0 and len(engine.affixes) == 0
    with pytest.raises(AffixStoreError, match=message):
        AffixStore(model).load(tmp_path)


def test_a_copied_fingerprint_does_not_make_another_models_cache_loadable(model, tmp_path):
    from acache.models.loader import load_model

    other = load_model(tiny_checkpoint(tmp_path / "other", "llada", seed=2))
    saved_store(other, tmp_path / "cache", A)
    mine = AffixStore(model).fingerprint
    rewrite(tmp_path / "cache", lambda t, m: m.update(model_fingerprint=mine))
    with pytest.raises(AffixStoreError, match="not computed from its tokens by this model"):
        AffixStore(model).load(tmp_path / "cache")


def test_a_cut_manifest_or_tensor_file_is_refused(model, tmp_path):
    manifest = saved_store(model, tmp_path, A)
    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text[:len(text) // 2])
    with pytest.raises(AffixStoreError, match="manifest.json: not a manifest"):
        AffixStore(model).load(tmp_path)
    (tmp_path / "manifest.json").write_text(text)
    blob = (tmp_path / manifest["tensors"]).read_bytes()
    (tmp_path / manifest["tensors"]).write_bytes(blob[:len(blob) // 2])
    with pytest.raises(AffixStoreError, match="not a safetensors file"):
        AffixStore(model).load(tmp_path)
    (tmp_path / manifest["tensors"]).unlink()
    with pytest.raises(AffixStoreError, match="names no readable tensor file"):
        AffixStore(model).load(tmp_path)


SAVER = """
import sys
from acache.affix.store import AffixStore
from acache.models.loader import load_model
model = load_model(sys.argv[1])
store = AffixStore(model)
for i in range(int(sys.argv[3])):
    store.acquire([(i * 7 + j) % 200 for j in range(120)])
print("ready", flush=True)
while True:
    store.save(sys.argv[2])
"""


def test_kill_during_save_and_concurrent_saves_leave_a_loadable_store(model, llada_dir, tmp_path):
    import subprocess
    import sys
    import time

    root = tmp_path / "cache"
    saved_store(model, root, A)
    procs = [subprocess.Popen([sys.executable, "-c", SAVER, str(llada_dir), str(root), str(n)],
                              stdout=subprocess.PIPE) for n in (30, 60)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == b"ready"
        landed = time.time() + 60  # "ready" comes before the first save: wait for one to land
        while AffixStore(model).load(root) < 30:
            assert time.time() < landed, "no save landed within a minute"
            time.sleep(0.05)
        for _ in range(6):  # two writers at once: every read sees a whole cache, never fewer entries (counted, not
            assert AffixStore(model).load(root) >= 30  # timed: a loaded machine reads slower, not differently)
    finally:
        for p in procs:
            p.kill()  # kill -9, most likely in the middle of a save
            p.wait()
    store = AffixStore(model)
    assert store.load(root) == 61  # the first entry and both writers' (their first 30 are the same): none lost
    assert not list(root.glob(".*.tmp-*"))  # the next start removed what the killed saves left
    assert len(list(root.glob("affixes-*.safetensors"))) >= 1


# -- healing: the server's load sets each fault aside and loads the rest ------------------------------


def tensor_span(path, name):
    """Where tensor ``name``'s bytes lie in a safetensors file."""
    blob = path.read_bytes()
    size = int.from_bytes(blob[:8], "little")
    begin, end = json.loads(blob[8:8 + size])[name]["data_offsets"]
    return 8 + size + begin, 8 + size + end


def flip_byte(root, manifest, key, tensor="k.1"):
    """One bit flipped in the middle of one entry's tensor, in place, as a bad disk or copy would."""
    path = root / manifest["tensors"]
    begin, end = tensor_span(path, f"{key}.{tensor}")
    blob = bytearray(path.read_bytes())
    blob[(begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(blob))


def key_of(ids):
    from acache.affix.prompt import affix_key

    return affix_key(ids)


def quarantined_reasons(root):
    return sorted((d.name, (d / "reason.txt").read_text()) for d in (root / "quarantine").iterdir())


def assert_healed(model, root, report, loaded, reason, caplog, names=()):
    """``loaded`` entries came in, one or more faults were set aside for ``reason`` (in the report, in a
    quarantine folder, in the log, by ``names``), and what is left on disk now loads strictly."""
    assert report.loaded == loaded
    assert report.quarantined and all(q.moved_to is not None and q.moved_to.parent == root / "quarantine"
                                      for q in report.quarantined)
    assert any(reason in q.reason for q in report.quarantined), report.quarantined
    assert any(reason in text for _, text in quarantined_reasons(root))
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "acache.affix")
    assert reason in logged and all(name in logged for name in names), logged
    if (root / "manifest.json").exists():
        assert AffixStore(model).load(root) == loaded  # the store was rewritten without the fault
    else:
        assert not list(root.glob("affixes-*.safetensors"))


def test_strict_load_still_refuses_what_recover_sets_aside(model, tmp_path):
    manifest = saved_store(model, tmp_path, A, B)
    flip_byte(tmp_path, manifest, key_of(A))
    with pytest.raises(AffixStoreError, match="do not match their checksum"):
        AffixStore(model).load(tmp_path)
    assert not (tmp_path / "quarantine").exists()


def test_a_flipped_byte_sets_that_entry_aside_and_the_other_loads(model, tmp_path, caplog):
    manifest = saved_store(model, tmp_path, A, B)
    flip_byte(tmp_path, manifest, key_of(A))
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert_healed(model, tmp_path, report, 1, "do not match their checksum", caplog, [key_of(A)[:12]])
    assert tuple(B) in store and tuple(A) not in store
    [folder] = [q.moved_to for q in report.quarantined]
    aside = json.loads((folder / "entry.json").read_text())
    assert aside["key"] == key_of(A) and (folder / "tensors.safetensors").stat().st_size > 0


@pytest.mark.parametrize("change, fix, message", [
    (nan, True, "NaN or infinite"),
    (short, True, "has shape"),
    (altered, False, "do not match their checksum"),
], ids=["nan", "wrong-shape", "altered"])
def test_a_bad_entry_is_set_aside_and_the_other_loads(model, tmp_path, caplog, change, fix, message):
    saved_store(model, tmp_path, A, B)
    rewrite(tmp_path, change, fix)  # each change hits the first entry's tensor of that layer
    report = AffixStore(model).recover(tmp_path)
    assert_healed(model, tmp_path, report, 1, message, caplog)
    assert len(report.quarantined) == 1


@pytest.mark.parametrize("fix", [True, False], ids=["resigned", "plain"])
def test_swapped_entries_are_both_set_aside(model, tmp_path, caplog, fix):
    saved_store(model, tmp_path, A, B, [20, 21, 22])
    rewrite(tmp_path, swap_first_two, fix)
    store = AffixStore(model)
    report = store.recover(tmp_path)
    message = "not computed from its tokens by this model" if fix else "do not match their checksum"
    assert_healed(model, tmp_path, report, 1, message, caplog, [key_of(A)[:12], key_of(B)[:12]])
    assert len(report.quarantined) == 2 and (20, 21, 22) in store


def swap_first_two(tensors, manifest):
    manifest["entries"], rest = manifest["entries"][:2], manifest["entries"][2:]
    swap(tensors, manifest)
    manifest["entries"] += rest


def test_a_deleted_tensor_of_one_entry_sets_that_entry_aside(model, tmp_path, caplog):
    saved_store(model, tmp_path, A, B)
    rewrite(tmp_path, lambda t, m: t.pop(f"{key_of(B)}.v.0"), fix_checksums=False)
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert_healed(model, tmp_path, report, 1, f"tensor {key_of(B)}.v.0 is missing", caplog)
    assert tuple(A) in store


def test_a_malformed_manifest_entry_is_set_aside_and_the_others_load(model, tmp_path, caplog):
    manifest = saved_store(model, tmp_path, A, B)
    del manifest["entries"][0]["token_ids"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    report = AffixStore(model).recover(tmp_path)
    assert_healed(model, tmp_path, report, 1, "an entry is malformed", caplog)


def test_a_truncated_tensor_file_keeps_the_entries_before_the_cut(model, tmp_path, caplog):
    manifest = saved_store(model, tmp_path, A, B)
    path = tmp_path / manifest["tensors"]
    last = max(tensor_span(path, f"{e['key']}.v.1")[1] for e in manifest["entries"])
    cut = min(tensor_span(path, f"{e['key']}.v.1")[1] for e in manifest["entries"])
    first = next(e["key"] for e in manifest["entries"] if tensor_span(path, f"{e['key']}.v.1")[1] == last)
    path.write_bytes(path.read_bytes()[:cut + 4])  # cut inside the tensors of whichever entry comes last
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert_healed(model, tmp_path, report, 1, "not a safetensors file", caplog, [first[:12]])
    assert len(report.quarantined) == 2  # the damaged file (a copy) and the entry past the cut
    assert {e.key for e in store.entries.values()} == {e["key"] for e in manifest["entries"]} - {first}


def test_a_tensor_file_cut_inside_its_header_sets_the_whole_store_aside(model, tmp_path, caplog):
    manifest = saved_store(model, tmp_path, A, B)
    path = tmp_path / manifest["tensors"]
    path.write_bytes(path.read_bytes()[:40])
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert_healed(model, tmp_path, report, 0, "not a safetensors file", caplog, [manifest["tensors"]])
    assert len(store) == 0 and not (tmp_path / "manifest.json").exists()
    [folder] = [q.moved_to for q in report.quarantined]
    assert {f.name for f in folder.iterdir()} == {"reason.txt", "manifest.json", manifest["tensors"]}


def test_a_cut_manifest_sets_the_whole_store_aside_and_starts_cold(model, tmp_path, caplog):
    saved_store(model, tmp_path, A, B)
    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text[:len(text) // 2])
    store = AffixStore(model)
    assert_healed(model, tmp_path, store.recover(tmp_path), 0, "not a manifest", caplog, ["manifest.json"])
    store.acquire(A)
    store.save(tmp_path)  # the directory is usable again at once
    assert AffixStore(model).load(tmp_path) == 1


def test_a_manifest_of_another_format_is_set_aside(model, tmp_path, caplog):
    manifest = saved_store(model, tmp_path, A)
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    assert_healed(model, tmp_path, AffixStore(model).recover(tmp_path), 0, "format 99", caplog)


def test_a_store_of_another_model_is_set_aside_not_deleted(model, tmp_path, caplog):
    from acache.models.loader import load_model

    other = load_model(tiny_checkpoint(tmp_path / "other", "llada", seed=2))
    root = tmp_path / "cache"
    saved_store(other, root, A, B)
    store = AffixStore(model)
    assert_healed(model, root, store.recover(root), 0, "was made with another model", caplog)
    [folder] = (root / "quarantine").iterdir()
    assert AffixStore(other).load(folder) == 2  # moved aside whole: its own model can still load it


def test_a_deleted_tensor_file_sets_the_manifest_aside(model, tmp_path, caplog):
    manifest = saved_store(model, tmp_path, A)
    (tmp_path / manifest["tensors"]).unlink()
    report = AffixStore(model).recover(tmp_path)
    assert_healed(model, tmp_path, report, 0, "names no readable tensor file", caplog)


def test_a_deleted_manifest_sets_its_tensor_files_aside(model, tmp_path, caplog):
    manifest = saved_store(model, tmp_path, A)
    (tmp_path / "manifest.json").unlink()
    report = AffixStore(model).recover(tmp_path)
    assert_healed(model, tmp_path, report, 0, "no manifest.json names them", caplog, [manifest["tensors"]])


def test_recover_of_an_empty_or_missing_directory_finds_nothing(model, tmp_path):
    assert AffixStore(model).recover(tmp_path / "nothing").quarantined == []
    assert AffixStore(model).recover(tmp_path).loaded == 0 and not (tmp_path / "quarantine").exists()


def test_a_read_only_store_is_read_around_its_fault_and_left_as_it_is(model, tmp_path, caplog, monkeypatch):
    manifest = saved_store(model, tmp_path, A, B)
    flip_byte(tmp_path, manifest, key_of(A))
    before = sorted(p.name for p in tmp_path.iterdir())
    tmp_path.chmod(0o555)
    if os.geteuid() == 0:  # root writes a read-only directory anyway: it is told the directory is not writable
        monkeypatch.setattr("acache.affix.persistence.os.access", lambda path, mode: False)
    try:
        store = AffixStore(model)
        report = store.recover(tmp_path)
    finally:
        tmp_path.chmod(0o755)
    assert report.loaded == 1 and tuple(B) in store
    assert [q.moved_to for q in report.quarantined] == [None]
    assert "read-only" in caplog.text and sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_set_aside_affix_is_recomputed_and_answers_as_without_a_store(tmp_path, llada_dir, caplog):
    """The LLM's healing mode: the corrupt affix is a miss, computed again, and every answer is token for
    token the answer of an LLM that never had a store; the sound one is a hit."""
    story = Affix("Mary moved to the kitchen. John went to the garden. ", name="story")
    notes = Affix("Sandra took the milk. Daniel left the office. ", name="notes")
    prompts = [[story, "Where is Mary?", GEN], [notes, "Who took the milk?", GEN]]
    params = SamplingParams(gen_length=16, block_length=8, threshold=0.5, selector="attention")
    first = LLM(llada_dir)
    first.generate(prompts, params, use_tqdm=False)
    manifest = json.loads((first.save_affix_cache(tmp_path) / "manifest.json").read_text())
    story_key = next(e["key"] for e in manifest["entries"] if e["name"] == "story")
    flip_byte(tmp_path, manifest, story_key, "v.0")
    with pytest.raises(AffixStoreError, match="do not match their checksum"):
        LLM(llada_dir, affix_cache_dir=tmp_path)  # the library's default stays strict
    healed = LLM(llada_dir, affix_cache_dir=tmp_path, affix_cache_quarantine=True)
    assert healed.affix_cache_report.loaded == 1
    assert [q.what for q in healed.affix_cache_report.quarantined] == [f"entry {story_key[:12]}"]
    got = healed.generate(prompts, params, use_tqdm=False)
    want = LLM(llada_dir).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.stats.affix.affix_hits, o.stats.affix.affix_misses) for o in got] == [(0, 1), (1, 0)]


def test_a_fault_that_cannot_be_moved_aside_is_skipped_and_the_rest_loads(model, tmp_path, caplog, monkeypatch):
    manifest = saved_store(model, tmp_path, A, B)
    flip_byte(tmp_path, manifest, key_of(A))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("acache.affix.persistence.quarantine", full_disk)
    monkeypatch.setattr("acache.affix.persistence.write_atomic", full_disk)
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert report.loaded == 1 and tuple(B) in store and [q.moved_to for q in report.quarantined] == [None]
    assert "No space left on device" in report.quarantined[0].reason and "could not rewrite" in caplog.text


# -- what a store keeps across saves and restarts ------------------------------------------------------


C, D = [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24]


def room_for(model, affixes):
    """A dense store with room for exactly ``affixes`` affixes of six tokens."""
    return AffixStore(model, max_bytes=AffixStore(model).storage.cost(6) * affixes)


def saved_keys(root):
    return [e["key"] for e in json.loads((root / "manifest.json").read_text())["entries"]]


def test_the_store_on_disk_never_outgrows_the_cache(model, tmp_path):
    for run in ([A, B], [C, D], [A, C]):
        store = room_for(model, 2)
        for ids in run:
            store.acquire(ids)
        store.save(tmp_path)
        assert saved_keys(tmp_path) == [key_of(ids) for ids in run]  # what it held, nothing older beside it
    assert len(list(tmp_path.glob("affixes-*.safetensors"))) == 1


def test_a_restart_with_less_room_keeps_the_most_recently_saved(model, tmp_path):
    first = room_for(model, 3)
    for ids in (A, B):
        first.acquire(ids)
    first.save(tmp_path)
    second = room_for(model, 3)  # another process of the model, which saw C alone
    second.acquire(C)
    second.save(tmp_path)
    assert saved_keys(tmp_path) == [key_of(A), key_of(B), key_of(C)]  # theirs kept, older first, its own last
    for load in ("load", "recover"):
        restarted = room_for(model, 2)
        assert getattr(restarted, load)(tmp_path) in (2, LoadReport(2))
        assert list(restarted.entries) == [key_of(B), key_of(C)]  # C the most recent, as when it was saved
    third = room_for(model, 2)
    third.acquire(D)
    third.save(tmp_path)
    assert saved_keys(tmp_path) == [key_of(C), key_of(D)]


def test_an_affix_already_held_is_neither_checked_nor_loaded_again(model, tmp_path, monkeypatch):
    saved_store(model, tmp_path, A, B)
    store = AffixStore(model)
    store.acquire(A)
    checked = []
    original = AffixDirectory._checked_entry

    def counting(self, item, tensors, file):
        checked.append(item["key"])
        return original(self, item, tensors, file)

    monkeypatch.setattr(AffixDirectory, "_checked_entry", counting)
    assert store.load(tmp_path) == 1 and list(store.entries) == [key_of(A), key_of(B)]
    assert checked == [key_of(A), key_of(B)]  # strict: every entry checked, the held one not placed


def test_running_out_of_memory_while_checking_stops_and_leaves_the_store(model, tmp_path, monkeypatch, caplog):
    saved_store(model, tmp_path, A, B)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    monkeypatch.setattr("acache.affix.persistence.first_layer_kv",
                        lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))
    report = AffixStore(model).recover(tmp_path)
    assert report.loaded == 0 and report.quarantined == [] and "out of memory checking the entries" in caplog.text
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_an_entry_that_fails_in_a_way_nobody_foresaw_is_set_aside_and_the_server_starts(model, tmp_path, caplog):
    saved_store(model, tmp_path, A, B)
    rewrite(tmp_path, lambda t, m: m["entries"][0].update(token_ids=[1e400]), fix_checksums=False)
    store = AffixStore(model)
    report = store.recover(tmp_path)  # int(inf) raises OverflowError inside the entry's check
    assert report.loaded == 1 and tuple(B) in store and "OverflowError" in report.quarantined[0].reason


def test_running_out_of_memory_while_placing_loads_what_fits_and_leaves_the_store(model, tmp_path, monkeypatch,
                                                                                  caplog):
    saved_store(model, tmp_path, A, B)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    placed = []

    def one_then_full(entry, device, dtype):
        if placed:
            raise torch.OutOfMemoryError("CUDA out of memory")
        placed.append(entry.key)
        return entry

    monkeypatch.setattr("acache.affix.persistence._to_device", one_then_full)
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert report.loaded == 1 and report.quarantined == [] and list(store.entries) == [key_of(B)]
    assert "out of memory placing affix" in caplog.text
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert not (tmp_path / "quarantine").exists()


def test_a_lock_file_that_cannot_be_opened_is_read_without_changing_anything(model, tmp_path, caplog):
    manifest = saved_store(model, tmp_path, A, B)
    flip_byte(tmp_path, manifest, key_of(A))
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").mkdir()  # an earlier run's debris where the lock file goes
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert report.loaded == 1 and tuple(B) in store and [q.moved_to for q in report.quarantined] == [None]
    assert "reading it without changing anything" in caplog.text and not (tmp_path / "quarantine").exists()


def test_tensor_files_a_sound_manifest_does_not_name_are_removed(model, tmp_path):
    manifest = saved_store(model, tmp_path, A)
    (tmp_path / "affixes-0000000000000000.safetensors").write_bytes(b"a save that died before its manifest")
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert report.loaded == 1 and report.quarantined == []
    assert [p.name for p in tmp_path.glob("affixes-*.safetensors")] == [manifest["tensors"]]


def test_a_store_computed_at_another_precision_is_named_for_it(tmp_path, llada_dir, caplog):
    from acache.models.loader import load_model

    full, half = load_model(llada_dir), load_model(llada_dir, dtype=torch.bfloat16)
    saved_store(half, tmp_path, A)
    with pytest.raises(AffixStoreError, match="was computed in bfloat16, while this model runs in float32"):
        AffixStore(full).load(tmp_path)
    report = AffixStore(full).recover(tmp_path)
    assert report.loaded == 0 and "computed in bfloat16" in report.quarantined[0].reason
    [folder] = (tmp_path / "quarantine").iterdir()
    assert AffixStore(half).load(folder) == 1  # set aside whole: the bfloat16 server can still load it


def test_a_save_sets_another_models_store_aside_rather_than_overwrite_it(model, tmp_path, caplog):
    from acache.models.loader import load_model

    other = load_model(tiny_checkpoint(tmp_path / "other", "llada", seed=2))
    root = tmp_path / "cache"
    saved_store(other, root, A, B)
    saved_store(model, root, C)
    assert saved_keys(root) == [key_of(C)] and "made with another model" in caplog.text
    [folder] = (root / "quarantine").iterdir()
    assert AffixStore(other).load(folder) == 2


def test_a_server_save_copies_the_affixes_under_the_lock_and_writes_them_outside_it(tmp_path, llada_dir,
                                                                                    monkeypatch):
    import threading

    llm = LLM(llada_dir)
    llm.generate([[Affix("Mary moved to the kitchen. John went to the garden. "), "Where is Mary?", GEN]],
                 SamplingParams(gen_length=8, block_length=8, selector="attention"), use_tqdm=False)
    lock = threading.Lock()
    seen = {}
    snapshot, save = type(llm.engine.affixes).snapshot, AffixDirectory.save

    def watched_snapshot(self):
        seen["snapshot"] = lock.locked()
        return snapshot(self)

    def watched_save(self, saved, claim):
        seen["save"] = lock.locked()
        return save(self, saved, claim)

    monkeypatch.setattr(type(llm.engine.affixes), "snapshot", watched_snapshot)
    monkeypatch.setattr(AffixDirectory, "save", watched_save)
    llm.save_affix_cache(tmp_path, lock=lock)
    assert seen == {"snapshot": True, "save": False} and len(saved_keys(tmp_path)) == 1


def test_a_save_over_a_damaged_tensor_file_keeps_a_copy_and_the_entries_it_holds_whole(model, tmp_path, caplog):
    """A save read the damaged store as nothing and deleted it, with no copy and no log line."""
    manifest = saved_store(model, tmp_path, A, B)
    path = tmp_path / manifest["tensors"]
    cut = min(tensor_span(path, f"{e['key']}.v.1")[1] for e in manifest["entries"])
    last = next(e["key"] for e in manifest["entries"] if tensor_span(path, f"{e['key']}.v.1")[1] > cut)
    path.write_bytes(path.read_bytes()[:cut + 4])
    saved_store(model, tmp_path, C)
    assert saved_keys(tmp_path) == [e["key"] for e in manifest["entries"] if e["key"] != last] + [key_of(C)]
    reasons = [text for _, text in quarantined_reasons(tmp_path)]
    assert any("not a safetensors file" in r for r in reasons) and any("tensors are missing" in r for r in reasons)
    assert "set aside by a save" in caplog.text and last[:12] in caplog.text


@pytest.mark.parametrize("damage, reason", [
    (lambda root, m: (root / "manifest.json").write_text(json.dumps({**m, "format": 99})), "format 99"),
    (lambda root, m: (root / "manifest.json").write_text("{"), "not a manifest"),
    (lambda root, m: (root / "manifest.json").unlink(), "no manifest.json names them"),
], ids=["other-format", "cut-manifest", "no-manifest"])
def test_a_save_sets_a_store_it_cannot_read_aside(model, tmp_path, caplog, damage, reason):
    """A store of another format (another version sharing the directory) or one that cannot be read was replaced
    unseen by a save."""
    manifest = saved_store(model, tmp_path, A, B)
    damage(tmp_path, manifest)
    saved_store(model, tmp_path, C)
    assert saved_keys(tmp_path) == [key_of(C)]
    [(_, text)] = quarantined_reasons(tmp_path)
    assert reason in text and "set aside by a save" in caplog.text and reason in caplog.text
    [folder] = (tmp_path / "quarantine").iterdir()
    assert manifest["tensors"] in {f.name for f in folder.iterdir()}  # the tensors kept beside the reason


def test_a_directory_that_cannot_be_read_is_a_clear_error_or_a_cold_start(model, tmp_path, monkeypatch, caplog):
    """``recover`` said it never raises for what it finds, yet a directory this process may not read raised a
    PermissionError (and the CLI printed a traceback)."""
    from pathlib import Path

    saved_store(model, tmp_path, A)
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if self.name == "manifest.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(AffixStoreError, match=f"{tmp_path}: cannot read the affix cache there .Permission denied"):
        AffixStore(model).load(tmp_path)
    store = AffixStore(model)
    report = store.recover(tmp_path)
    assert report.loaded == 0 and len(store) == 0
    assert [(q.what, q.moved_to) for q in report.quarantined] == [("the whole store", None)]
    assert "Permission denied" in report.quarantined[0].reason and "Permission denied" in caplog.text
    assert "skipped (not moved: it could not be read)" in caplog.text
    store.acquire(B)
    with pytest.raises(PermissionError):  # a save fails rather than move aside a store it could not read
        store.save(tmp_path)
    assert not (tmp_path / "quarantine").exists()
    monkeypatch.setattr(Path, "read_text", real)
    assert AffixStore(model).load(tmp_path) == 1  # nothing on disk was touched
