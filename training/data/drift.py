"""Drift between two data versions: PSI per feature and label for tables, Jensen-Shannon
divergence of byte unigrams for text.

Pure functions over profiles (training.data.profile): the reference's bins and counts,
and the new version's counts on those same bins. Nothing here knows where a reference
came from (training.mlops.drift finds the champion's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from training.data.profile import Shape

# A bin one side leaves empty counts as this share instead: PSI's log ratio stays finite,
# and a bin the reference never filled that now holds many rows still weighs heavily.
EPSILON = 1e-4
LABEL = "label"  # the label's name among the drifted features
TOP = 10  # symbols listed for text


def shares(counts: Any) -> np.ndarray:
    """Counts as proportions (all zeros stay zeros)."""
    values = np.asarray(counts, dtype=np.float64)
    total = values.sum()
    return values / total if total > 0 else values


def psi(expected: Any, actual: Any, eps: float = EPSILON) -> float:
    """Population stability index of `actual` against `expected` (counts per bin, the
    same bins): sum over bins of (a - e) * ln(a / e) on the shares, each at least `eps`.
    0 for the same distribution; the usual reading: under 0.1 stable, 0.1-0.25 a
    moderate shift, above 0.25 a major one."""
    e = np.maximum(shares(expected), eps)
    a = np.maximum(shares(actual), eps)
    if e.shape != a.shape:
        raise ValueError(f"bins differ: {e.shape} and {a.shape}")
    return float(np.sum((a - e) * np.log(a / e)))


def js_terms(p_counts: Any, q_counts: Any) -> np.ndarray:
    """Each symbol's share of the Jensen-Shannon divergence (base 2) of two count
    vectors; they sum to it. Symbols neither side holds add nothing."""
    p, q = shares(p_counts), shares(q_counts)
    m = (p + q) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        kl_p = np.where(p > 0, p * np.log2(p / m), 0.0)
        kl_q = np.where(q > 0, q * np.log2(q / m), 0.0)
    return (kl_p + kl_q) / 2


def js_divergence(p_counts: Any, q_counts: Any) -> float:
    """Jensen-Shannon divergence in bits: 0 for the same distribution, 1 for disjoint
    ones, symmetric, and finite whatever either side leaves empty."""
    return float(max(js_terms(p_counts, q_counts).sum(), 0.0))


def not_comparable(reference: Shape, new: Shape) -> str | None:
    """Why the new data cannot be compared with the reference (other kinds of data,
    other features, another kind of label), or None."""
    if reference.kind != new.kind:
        return f"the champion's data is {reference.kind}, the new data is {new.kind}"
    if reference.feature_shape != new.feature_shape or reference.names != new.names:
        return (
            f"the features changed: the champion's data had {len(reference.names)} "
            f"({_some(reference.names)}), the new data has {len(new.names)} "
            f"({_some(new.names)})"
        )
    if reference.classes != new.classes:
        return "the label changed between classes and values"
    return None


def _some(names: tuple[str, ...]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def table_drift(reference: dict[str, Any], counted: dict[str, Any]) -> dict[str, Any]:
    """PSI of every feature and of the label: the new version's counts on the
    reference's bins (`counted`, from training.data.profile.profile_raw) against the
    reference's own counts. Features are listed most drifted first."""
    names = reference["features"]["names"]
    values = [
        psi(expected, actual)
        for expected, actual in zip(
            reference["features"]["counts"], counted["features"]["counts"], strict=True
        )
    ]
    ranked = sorted(zip(names, values, strict=True), key=lambda item: -item[1])
    label = reference["label"]
    if "classes" in label:
        ids = sorted({*label["classes"], *counted["label"]["classes"]}, key=int)
        expected = [label["classes"].get(c, 0) for c in ids]
        actual = [counted["label"]["classes"].get(c, 0) for c in ids]
        label_psi = psi(expected, actual)
    else:
        label_psi = psi(label["counts"], counted["label"]["counts"])
    top_name, top_value = ranked[0] if ranked else ("", 0.0)
    return {
        "kind": reference["kind"],
        "measure": "psi",
        "rows": {"reference": reference["rows"], "new": counted["rows"]},
        "psi_max": round(top_value, 6),
        "psi_max_feature": top_name,
        "label_psi": round(label_psi, 6),
        "features": [[name, round(value, 6)] for name, value in ranked],
    }


def symbol_name(byte: int) -> str:
    """A byte as a reader knows it: the character when printable ASCII, else its hex."""
    char = chr(byte)
    return repr(char) if 32 <= byte < 127 or char in "\n\t" else f"0x{byte:02x}"


def text_drift(reference: dict[str, Any], counted: dict[str, Any]) -> dict[str, Any]:
    """Jensen-Shannon divergence of the byte unigrams, and the bytes that account for
    most of it (with their shares before and after)."""
    terms = js_terms(reference["counts"], counted["counts"])
    before, after = shares(reference["counts"]), shares(counted["counts"])
    order = np.argsort(-terms, kind="stable")[:TOP]
    return {
        "kind": "tokens",
        "measure": "js",
        "basis": reference.get("basis", "bytes"),
        "bytes": {"reference": reference["bytes"], "new": counted["bytes"]},
        "js": round(float(max(terms.sum(), 0.0)), 6),
        "top": [
            [symbol_name(int(i)), round(float(terms[i]), 6), float(before[i]), float(after[i])]
            for i in order
            if terms[i] > 0
        ],
    }


def compare(reference: dict[str, Any], counted: dict[str, Any]) -> dict[str, Any]:
    """The drift of the new version (`counted` on the reference's bins) from `reference`."""
    if reference["kind"] == "tokens":
        return text_drift(reference, counted)
    return table_drift(reference, counted)


def over_threshold(
    drift: dict[str, Any], psi_threshold: float, js_threshold: float
) -> list[tuple[str, float]]:
    """(name, value) of what drifted past its threshold, most drifted first: features
    and the label by PSI (tables), the whole text by JS divergence."""
    if drift.get("measure") == "js":
        return [("text (byte unigrams)", drift["js"])] if drift["js"] > js_threshold else []
    found = [(name, value) for name, value in drift["features"] if value > psi_threshold]
    if drift["label_psi"] > psi_threshold:
        found.append((LABEL, drift["label_psi"]))
    return sorted(found, key=lambda item: -item[1])
