"""The flow's background imports (tasks/warm_imports.py): every queued module is
imported by the time `wait_for_background_imports` returns, one that cannot be imported
stops nothing, and modules are imported one after another, never side by side."""

from __future__ import annotations

import sys
import threading

from tasks import warm_imports


def test_queued_modules_are_imported_in_order_one_at_a_time(tmp_path, monkeypatch) -> None:
    # Three throwaway modules that note who imports them and whether another import of
    # theirs was under way at the same time.
    journal: list[tuple[str, str, bool]] = []
    busy = threading.Lock()
    monkeypatch.setattr(sys, "gradline_test_journal", (journal, busy), raising=False)
    body = (
        "import sys, threading, time\n"
        "journal, busy = sys.gradline_test_journal\n"
        "alone = busy.acquire(blocking=False)\n"
        "time.sleep(0.05)\n"
        "journal.append((__name__, threading.current_thread().name, alone))\n"
        "if alone:\n"
        "    busy.release()\n"
    )
    names = [f"gradline_warm_probe_{i}" for i in range(3)]
    for name in names:
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))

    warm_imports.import_in_background(names[0], "gradline_no_such_module", names[1])
    warm_imports.import_in_background(names[2])
    warm_imports.wait_for_background_imports()

    assert [entry[0] for entry in journal] == names  # all of them, in the order queued
    assert {entry[1] for entry in journal} == {"warm-imports"}  # in the background
    assert all(alone for _, _, alone in journal)  # never two at once
    for name in names:
        sys.modules.pop(name, None)
