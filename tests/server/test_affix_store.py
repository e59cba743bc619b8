"""The server over an ``--affix-cache-dir``: registered affixes survive a restart, and a store or registry
that went bad is set aside (quarantined) instead of keeping the server down."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from acache import LLM
from acache.server.app import create_app

STORY = "Mary moved to the kitchen. John went to the garden. Mary took the apple. "
SYSTEM = [{"role": "system", "content": "Sandra took the milk. Daniel left the office."}]
COMPLETION = {"prompt": "Where is Mary?", "max_tokens": 8}
CHAT = {"messages": [{"role": "user", "content": "Who took the milk?"}], "max_tokens": 8}


def server(llada_dir, cache=None):
    """An app over a fresh LLM; with ``cache``, loaded from it as ``acache serve`` does (healing)."""
    llm = LLM(llada_dir, page_size=8, kv_cache_memory=1 << 22, affix_cache_dir=cache if cache and cache.is_dir()
              else None, affix_cache_quarantine=True)
    return TestClient(create_app(llm, "tiny", affix_cache_dir=cache))


def register(client, **body):
    resp = client.post("/v1/affixes", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def answers(client, text_id, chat_id):
    """Token ids of a completion with the text affix and a chat with the messages affix."""
    done = client.post("/v1/completions", json={**COMPLETION, "affix": text_id})
    chat = client.post("/v1/chat/completions", json={**CHAT, "affix": chat_id})
    assert done.status_code == chat.status_code == 200, (done.text, chat.text)
    return done.json()["choices"][0]["token_ids"], chat.json()["choices"][0]["token_ids"]


def test_registered_ids_survive_a_save_and_a_restart(llada_dir, tmp_path):
    cache = tmp_path / "cache"
    with server(llada_dir, cache) as first:
        text_id, chat_id = register(first, text=STORY, name="story"), register(first, messages=SYSTEM)
        before = answers(first, text_id, chat_id)
        saved = first.post("/v1/affixes/save")
        assert saved.status_code == 200 and saved.json()["saved"] == 2
    stored = json.loads((cache / "registry.json").read_text())["affixes"]
    assert {a["id"] for a in stored} == {text_id, chat_id}
    assert next(a for a in stored if a["id"] == text_id)["name"] == "story"
    with server(llada_dir, cache) as second:
        assert answers(second, text_id, chat_id) == before
        assert second.app.state.engine.engine.affixes.stats.hits == 2  # their K/V came back too


def test_an_id_registered_but_never_used_survives_a_shutdown(llada_dir, tmp_path):
    """Registered, never used (so no K/V was ever computed), the server stopped: the id is still known after
    the restart, and answers as a server that never had a store."""
    cache = tmp_path / "cache"
    with server(llada_dir, cache) as first:
        text_id, chat_id = register(first, text=STORY), register(first, messages=SYSTEM)
    assert not json.loads((cache / "manifest.json").read_text())["entries"]
    with server(llada_dir, cache) as second:
        got = answers(second, text_id, chat_id)
    with server(llada_dir) as fresh:
        assert (register(fresh, text=STORY), register(fresh, messages=SYSTEM)) == (text_id, chat_id)
        assert answers(fresh, text_id, chat_id) == got


def saved_registry(llada_dir, cache):
    with server(llada_dir, cache) as first:
        ids = register(first, text=STORY), register(first, messages=SYSTEM)
    return ids, json.loads((cache / "registry.json").read_text())


def assert_set_aside(cache, caplog, reason):
    folders = list((cache / "quarantine").iterdir())
    assert any(reason in (f / "reason.txt").read_text() for f in folders), folders
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "acache.server")
    assert reason in logged and "affix registry" in logged


def unknown(client, affix_id):
    resp = client.post("/v1/completions", json={**COMPLETION, "affix": affix_id})
    return resp.status_code == 400 and "unknown affix id" in resp.json()["error"]["message"]


@pytest.mark.parametrize("damage, reason", [
    (lambda text: text[:len(text) // 2].encode(), "not a registry"),
    (lambda text: b"\xff\xfe" + text.encode(), "not a registry"),
    (lambda text: json.dumps({**json.loads(text), "format": 7}).encode(), "format 7"),
    (lambda text: json.dumps({**json.loads(text), "model_fingerprint": "0" * 64}).encode(), "made with another model"),
], ids=["truncated", "not-utf8", "other-format", "other-model"])
def test_a_bad_registry_file_is_set_aside_and_the_server_starts(llada_dir, tmp_path, caplog, damage, reason):
    cache = tmp_path / "cache"
    (text_id, _), _ = saved_registry(llada_dir, cache)
    path = cache / "registry.json"
    path.write_bytes(damage(path.read_text()))
    caplog.set_level(logging.WARNING)
    with server(llada_dir, cache) as second:
        assert second.get("/health").status_code == 200
        assert unknown(second, text_id)
        assert register(second, text=STORY) == text_id  # registering again gives the same id back
    assert_set_aside(cache, caplog, reason)
    assert [a["id"] for a in json.loads(path.read_text())["affixes"]] == [text_id]  # saved anew at shutdown


def altered_tokens(item):
    item["tokens"][0] = (item["tokens"][0] + 1) % 100


@pytest.mark.parametrize("damage, reason", [
    (altered_tokens, "does not hash to its id"),
    (lambda item: item.pop("tokens"), "malformed"),
    (lambda item: item.update(tokens=[10 ** 9]), "outside the vocabulary"),
    (lambda item: item.update(name=5), "name is not a string"),
], ids=["altered", "missing-field", "token-out-of-vocabulary", "bad-name"])
def test_a_bad_registration_is_set_aside_and_the_others_load(llada_dir, tmp_path, caplog, damage, reason):
    cache = tmp_path / "cache"
    (text_id, chat_id), body = saved_registry(llada_dir, cache)
    damage(next(a for a in body["affixes"] if a["id"] == text_id))
    (cache / "registry.json").write_text(json.dumps(body))
    caplog.set_level(logging.WARNING)
    with server(llada_dir, cache) as second:
        assert unknown(second, text_id)
        chat = second.post("/v1/chat/completions", json={**CHAT, "affix": chat_id})
        assert chat.status_code == 200
    assert_set_aside(cache, caplog, reason)
    assert text_id in "\n".join(r.getMessage() for r in caplog.records)
    [folder] = (cache / "quarantine").iterdir()
    assert json.loads((folder / "registration.json").read_text())["id"] == text_id


def flip_byte(cache, key):
    """One bit flipped in one of the entry's tensors, in place."""
    manifest = json.loads((cache / "manifest.json").read_text())
    path = cache / manifest["tensors"]
    blob = bytearray(path.read_bytes())
    size = int.from_bytes(blob[:8], "little")
    begin, end = json.loads(bytes(blob[8:8 + size]))[f"{key}.k.1"]["data_offsets"]
    blob[8 + size + (begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(blob))


def test_a_corrupt_affix_is_recomputed_and_answers_as_a_server_without_a_store(llada_dir, tmp_path, caplog):
    cache = tmp_path / "cache"
    with server(llada_dir, cache) as first:
        text_id, chat_id = register(first, text=STORY), register(first, messages=SYSTEM)
        answers(first, text_id, chat_id)
        story_key = next(e.key for e in first.app.state.engine.engine.affixes.entries.values()
                         if len(e.token_ids) == len(first.app.state.registry.get(text_id)[0]))
    flip_byte(cache, story_key)
    caplog.set_level(logging.WARNING)
    with server(llada_dir, cache) as second:
        affixes = second.app.state.engine.engine.affixes
        assert len(affixes) == 1 and story_key not in affixes.entries  # the other entry loaded
        got = answers(second, text_id, chat_id)
        assert (affixes.stats.hits, affixes.stats.misses) == (1, 1)  # the corrupt one was computed again
    assert story_key[:12] in caplog.text and "do not match their checksum" in caplog.text
    with server(llada_dir) as fresh:
        register(fresh, text=STORY), register(fresh, messages=SYSTEM)
        assert answers(fresh, text_id, chat_id) == got


def test_two_servers_saving_to_one_directory_keep_each_others_registrations(tmp_path):
    from acache.server.affix_reuse import AffixRegistry, _size

    one, two = AffixRegistry(), AffixRegistry()
    a, b = one.register([1, 2, 3], None, "a"), two.register([4, 5], None, None)
    one.save(tmp_path, "fp")
    two.save(tmp_path, "fp")
    back = AffixRegistry()
    assert back.load(tmp_path, "fp", 100) == [] and len(back) == 2
    assert back.get(a) == ((1, 2, 3), None, "a") and back.get(b) == ((4, 5), None, None)
    # a third with room for its own and one more: the file stays within its budget, the most recent kept
    small = AffixRegistry(max_bytes=_size([9], None, None) + _size([4, 5], None, None))
    c = small.register([9], None, None)
    assert small.save(tmp_path, "fp") == 2
    assert [r["id"] for r in json.loads((tmp_path / "registry.json").read_text())["affixes"]] == [b, c]


def test_acache_serve_starts_over_a_store_whose_manifest_is_cut(tmp_path):
    """``acache serve`` itself: a cut manifest no longer exits 2; the server says what it set aside, starts
    cold, answers as before, and the registered id (its registry is sound) still works."""
    from tests.server.helpers import start_server
    from tests.server.test_front_door import CHAT as DOOR_CHAT
    from tests.server.test_front_door import STORY as DOOR_STORY
    from tests.server.test_front_door import call

    cache = tmp_path / "affixes"
    chat = {"messages": DOOR_CHAT, "max_tokens": 2}

    def ask(port, affix_id):
        texts = []
        for body, path in ((chat, "/v1/chat/completions"), (chat, "/v1/chat/completions"),
                           ({"prompt": "where is john ?", "affix": affix_id, "max_tokens": 2}, "/v1/completions")):
            status, text = call(port, "POST", path, body, auth=None)
            assert status == 200, text
            texts.append(json.loads(text)["choices"][0]["token_ids"])
        return texts

    proc, port = start_server(["--affix-cache-dir", str(cache)])
    try:
        status, text = call(port, "POST", "/v1/affixes", {"text": DOOR_STORY}, auth=None)
        affix_id = json.loads(text)["id"]
        before = ask(port, affix_id)  # the system prompt seen once, then shared; the registered affix used
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    manifest = (cache / "manifest.json").read_text()
    assert len(json.loads(manifest)["entries"]) == 2
    (cache / "manifest.json").write_text(manifest[:len(manifest) // 2])
    proc, port = start_server(["--affix-cache-dir", str(cache)])
    try:
        assert ask(port, affix_id) == before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out = proc.stdout.read().decode()
    assert "manifest.json: not a manifest" in out and "set aside" in out, out
    assert len(list((cache / "quarantine").iterdir())) == 1


def test_a_save_drops_a_bad_registration_it_finds_and_keeps_the_sound_ones(tmp_path):
    from acache.server.affix_reuse import AffixRegistry

    one = AffixRegistry()
    a = one.register([1, 2, 3], None, None)
    one.save(tmp_path, "fp")
    body = json.loads((tmp_path / "registry.json").read_text())
    body["affixes"].insert(0, {"tokens": [5]})  # malformed, before the sound one
    (tmp_path / "registry.json").write_text(json.dumps(body))
    two = AffixRegistry()
    b = two.register([4], None, None)
    assert two.save(tmp_path, "fp") == 2
    assert [r["id"] for r in json.loads((tmp_path / "registry.json").read_text())["affixes"]] == [a, b]


def test_a_save_sets_another_models_registry_aside_rather_than_overwrite_it(tmp_path, caplog):
    from acache.server.affix_reuse import AffixRegistry

    theirs, mine = AffixRegistry(), AffixRegistry()
    a = theirs.register([1, 2, 3], None, "a")
    theirs.save(tmp_path, "their-model")
    mine.register([4, 5], None, None)
    with caplog.at_level(logging.WARNING, logger="acache.server"):
        assert mine.save(tmp_path, "my-model") == 1
    assert "made with another model" in caplog.text
    [folder] = (tmp_path / "quarantine").iterdir()
    back = AffixRegistry()
    assert back.load(folder, "their-model", 100) == [] and back.get(a) == ((1, 2, 3), None, "a")


def test_a_registry_whose_lock_file_cannot_be_opened_loads_and_the_server_starts(llada_dir, tmp_path, caplog):
    cache = tmp_path / "cache"
    (text_id, chat_id), _ = saved_registry(llada_dir, cache)
    (cache / ".lock").unlink()
    (cache / ".lock").mkdir()
    with caplog.at_level(logging.WARNING), server(llada_dir, cache) as second:
        assert not unknown(second, text_id) and not unknown(second, chat_id)
    assert "reading it without changing anything" in caplog.text
    assert "could not save the shared affixes" in caplog.text  # the shutdown's save failed, said, not raised


def test_two_saves_at_once_write_in_turn_snapshot_to_write(llada_dir, tmp_path, monkeypatch):
    import threading
    import time

    from acache.affix.cache import AffixCache
    from acache.affix.persistence import AffixDirectory

    cache = tmp_path / "cache"
    events = []
    snapshot, save = AffixCache.snapshot, AffixDirectory.save

    def noted_snapshot(self):
        events.append("snapshot")
        return snapshot(self)

    def slow_save(self, saved, claim):
        events.append("write")
        time.sleep(0.3)  # a second save arriving now must not snapshot before this one is written
        return save(self, saved, claim)

    with server(llada_dir, cache) as client:
        assert client.post("/v1/completions", json={**COMPLETION, "affix": register(client, text=STORY)}).status_code \
            == 200
        monkeypatch.setattr(AffixCache, "snapshot", noted_snapshot)
        monkeypatch.setattr(AffixDirectory, "save", slow_save)
        saves = [threading.Thread(target=client.app.state.save_affixes) for _ in range(2)]
        for t in saves:
            t.start()
        for t in saves:
            t.join(10)
        assert events == ["snapshot", "write", "snapshot", "write"]
        monkeypatch.setattr(AffixDirectory, "save", save)
        assert client.post("/v1/affixes/save").json()["saved"] == 1


@pytest.mark.parametrize("damage, reason", [
    (lambda text: text[:len(text) // 2], "not a registry"),
    (lambda text: json.dumps({**json.loads(text), "format": 7}), "format 7"),
], ids=["truncated", "other-format"])
def test_a_save_sets_a_registry_it_cannot_read_aside(tmp_path, caplog, damage, reason):
    """Another server's registry that a save could not read was replaced unseen: its clients' ids were gone after
    a restart with nothing logged."""
    from acache.server.affix_reuse import AffixRegistry

    theirs, mine = AffixRegistry(), AffixRegistry()
    theirs.register([1, 2, 3], None, "a")
    theirs.save(tmp_path, "fp")
    path = tmp_path / "registry.json"
    text = path.read_text()
    path.write_text(damage(text))
    mine.register([4, 5], None, None)
    with caplog.at_level(logging.WARNING, logger="acache.server"):
        assert mine.save(tmp_path, "fp") == 1
    assert reason in caplog.text and "set aside by a save" in caplog.text
    [folder] = (tmp_path / "quarantine").iterdir()
    assert (folder / "registry.json").read_text() == damage(text)


def test_a_save_sets_a_malformed_registration_aside(tmp_path, caplog):
    from acache.server.affix_reuse import AffixRegistry

    theirs, mine = AffixRegistry(), AffixRegistry()
    bad, good = theirs.register([1, 2, 3], None, "a"), theirs.register([6, 7], None, "b")
    theirs.save(tmp_path, "fp")
    path = tmp_path / "registry.json"
    body = json.loads(path.read_text())
    body["affixes"][0]["tokens"][0] = 9  # no longer hashes to its id
    path.write_text(json.dumps(body))
    mine.register([4, 5], None, None)
    with caplog.at_level(logging.WARNING, logger="acache.server"):
        assert mine.save(tmp_path, "fp") == 2
    assert [a["id"] for a in json.loads(path.read_text())["affixes"]][0] == good
    [folder] = (tmp_path / "quarantine").iterdir()
    assert json.loads((folder / "registration.json").read_text())["id"] == bad
    assert "does not hash to its id" in caplog.text and bad in caplog.text


def test_a_save_that_fails_says_why_to_the_client(llada_dir, tmp_path, monkeypatch, caplog):
    """A full disk on POST /v1/affixes/save was an opaque 500 ("internal error; the server log has the details")."""
    cache = tmp_path / "cache"

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    with server(llada_dir, cache) as client:
        register(client, text=STORY)
        monkeypatch.setattr("acache.affix.persistence.write_atomic", full)
        resp = client.post("/v1/affixes/save")
        assert resp.status_code == 500, resp.text
        message = resp.json()["error"]["message"]
        assert message.startswith(f"could not save the shared affixes to {cache}: ") and "No space left" in message
        monkeypatch.undo()
        assert client.post("/v1/affixes/save").status_code == 200  # the directory is usable again at once


def test_a_cache_dir_the_server_cannot_write_is_said_at_start(llada_dir, tmp_path, monkeypatch, caplog):
    """It was found only at shutdown, when the save failed and the session's affixes were lost."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setattr("acache.server.serving_affixes.os.access", lambda path, mode: False)
    with caplog.at_level(logging.WARNING, logger="acache.server"), server(llada_dir, cache) as client:
        assert client.get("/health").status_code == 200
        assert f"--affix-cache-dir {cache} cannot be written (no write permission)" in caplog.text


def test_a_registry_that_cannot_be_read_is_left_where_it_is(llada_dir, tmp_path, monkeypatch, caplog):
    """A registry this server may not read (a permission, the disk) is no evidence of damage: it was moved aside
    at start, and a save then replaced it with this server's registrations alone."""
    from pathlib import Path

    from acache.server.affix_reuse import AffixRegistry

    theirs = AffixRegistry()
    theirs.register([1, 2, 3], None, "a")
    theirs.save(tmp_path, "fp")
    before = (tmp_path / "registry.json").read_text()
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if self.name == "registry.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    mine = AffixRegistry()
    with caplog.at_level(logging.WARNING, logger="acache.server"):
        [aside] = mine.load(tmp_path, "fp", 100)
    assert aside.moved_to is None and "skipped (not moved: it could not be read)" in caplog.text
    mine.register([4, 5], None, None)
    with pytest.raises(PermissionError):
        mine.save(tmp_path, "fp")
    monkeypatch.setattr(Path, "read_text", real)
    assert (tmp_path / "registry.json").read_text() == before and not (tmp_path / "quarantine").exists()
