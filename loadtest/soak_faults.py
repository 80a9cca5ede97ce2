"""A soak's scheduled faults and changes, each recorded with when it ran, whether it did what it
should and how long the server took to be whole again.

In turn: add a document, kill a shard actor (Ray restarts it), forget the added document with
erase (no byte of it may stay below the datastore root), hot-swap a datastore to a copy and back,
stop a shard actor for a few seconds (SIGSTOP, SIGCONT), compact, rotate a tenant's key.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import requests
import yaml
from soak_traffic import Traffic

from knnlm_core.keys_file import key_hash

ORDER = ("add", "kill", "forget", "swap", "stop", "compact", "rotate")
STOPPED_S = 5.0
# Requests that end this long after a fault that takes a shard away may still be served LM-only.
GRACE_S = 10.0


class Faults:
    def __init__(self, traffic: Traffic, token: str, root: Path, keys_file: Path, keys: list[dict]):
        self.traffic, self.token, self.root, self.keys_file, self.keys = traffic, token, root, keys_file, keys
        self.records: list[dict] = []
        self.added: list[tuple[int, str]] = []  # (document, its text) added and not forgotten yet
        self.turn = 0

    def admin(self, method: str, route: str, **kwargs) -> requests.Response:
        return requests.request(
            method, f"{self.traffic.base_url}/v1/knn{route}", headers={"X-Admin-Token": self.token}, timeout=600, **kwargs
        )

    def run_next(self) -> dict:
        kind = ORDER[self.turn % len(ORDER)]
        self.turn += 1
        record = {"fault": kind, "start_s": round(self.traffic.now(), 1)}
        try:
            record.update(getattr(self, kind)())
            record.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 - a fault that fails is a finding, the soak goes on
            record.update(ok=False, error=repr(e)[:300])
        record["end_s"] = round(self.traffic.now(), 1)
        self.records.append(record)
        return record

    def job(self, response: requests.Response) -> dict:
        response.raise_for_status()
        job = response.json()
        while job["state"] == "running":
            time.sleep(1)
            job = self.admin("GET", f"/jobs/{job['id']}").json()
        if job["state"] != "done":
            raise RuntimeError(f"{job['kind']} job failed: {job['error']}")
        return job

    def add(self) -> dict:
        text = f"Soak note {uuid.uuid4().hex}: the lighthouse keeper logged a calm night and a passing ferry."
        job = self.job(self.admin("POST", "/datastores/alpha/documents", json={"texts": [{"text": text, "id": f"alpha-soak-{self.turn}"}]}))
        self.added.append((job["record"]["first_document"], text))
        return {"version": job["version"], "seconds": job["seconds"]}

    def forget(self) -> dict:
        if not self.added:
            return {"skipped": "nothing added"}
        document, text = self.added.pop(0)
        response = self.admin("DELETE", f"/datastores/alpha/documents/{document}", params={"erase": "true"})
        response.raise_for_status()
        copies = [str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]
        return {"document": document, "copies_left": copies, "ok": not copies}

    def compact(self) -> dict:
        job = self.job(self.admin("POST", "/datastores/alpha/compact", json={}))
        return {"version": job["version"], "seconds": job["seconds"]}

    def swap(self) -> dict:
        for path in ("beta-copy", "beta"):
            self.admin("POST", "/datastores", json={"name": "beta", "path": str(self.root / path)}).raise_for_status()
        return {}

    def rotate(self) -> dict:
        """A new secret for the first tenant: both valid while its clients switch, then the old one
        is refused."""
        tenant = self.traffic.tenants[0]
        old, new = tenant.key, f"sk-knn-soak-{uuid.uuid4().hex}"
        entry = next(k for k in self.keys if k["id"] == tenant.key_id)
        self.write_keys([*self.keys, {**entry, "id": f"{tenant.key_id}-next", "sha256": key_hash(new)}])
        with self.traffic.lock:
            tenant.key = new
        # The old key goes once no request sent with it is still waiting for its answer.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with self.traffic.lock:
                if old not in self.traffic.sending.values():
                    break
            time.sleep(0.5)
        entry["sha256"] = key_hash(new)
        self.write_keys(self.keys)
        refused = requests.get(f"{self.traffic.base_url}/v1/models", headers={"Authorization": f"Bearer {old}"}, timeout=60)
        return {"old_key_status": refused.status_code, "ok": refused.status_code == 401}

    def write_keys(self, keys: list[dict]) -> None:
        part = self.keys_file.with_suffix(".part")
        part.write_text(yaml.safe_dump({"keys": keys}, sort_keys=False))
        part.replace(self.keys_file)

    def shard(self) -> dict:
        shards = [s for s in self.admin("GET", "/health").json()["shards"] if s["status"] == "ok"]
        return shards[self.turn % len(shards)]

    def kill(self) -> dict:
        shard = self.shard()
        os.kill(shard["pid"], signal.SIGKILL)
        return {"actor": shard["actor"], "recovered_s": self.recovered(time.monotonic())}

    def stop(self) -> dict:
        shard = self.shard()
        os.kill(shard["pid"], signal.SIGSTOP)
        time.sleep(STOPPED_S)
        os.kill(shard["pid"], signal.SIGCONT)
        return {"actor": shard["actor"], "stopped_s": STOPPED_S, "recovered_s": self.recovered(time.monotonic())}

    def recovered(self, since: float, timeout: float = 300) -> float:
        """Seconds until every shard answers the health check again."""
        while time.monotonic() - since < timeout:
            health = self.admin("GET", "/health").json()
            if all(s["status"] == "ok" for s in health["shards"]):
                return round(time.monotonic() - since, 1)
            time.sleep(0.5)
        raise TimeoutError(f"a shard was still unavailable {timeout:.0f} s later")


def fault_loop(faults: Faults, every_s: float, stop: threading.Event) -> None:
    """A fault every `every_s` seconds, the first one interval in, until `stop`."""
    while not stop.wait(every_s):
        record = faults.run_next()
        print(f"soak: fault {record['fault']} at {record['start_s']:.0f} s: {'ok' if record['ok'] else 'FAILED'} {record}", flush=True)


def in_fault_window(record: dict, faults: list[dict]) -> bool:
    """Whether a request overlapped a fault that takes kNN away from some rows (a shard killed or
    stopped, a swap), up to GRACE_S after it."""
    return any(
        f["fault"] in ("kill", "stop", "swap") and record["start_s"] <= f["end_s"] + GRACE_S and record["end_s"] >= f["start_s"]
        for f in faults
    )
