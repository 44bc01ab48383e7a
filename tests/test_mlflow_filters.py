"""MLflow search filters are built from values (training.mlops.filters), never pasted."""

from __future__ import annotations

import pytest

from training.errors import TrackingError
from training.mlops.filters import equals, quoted


def test_values_are_quoted_with_the_quote_they_lack() -> None:
    assert equals(name="gradline-digits", run_id="abc") == (
        "name = 'gradline-digits' and run_id = 'abc'"
    )
    assert quoted("it's") == '"it\'s"'


@pytest.mark.parametrize("value", ['it\'s "x"', "a\\", "a\nb"])
def test_values_a_filter_cannot_hold_are_refused_naming_them(value) -> None:
    with pytest.raises(TrackingError, match="cannot be searched for in MLflow"):
        equals(name=value)


def test_a_name_with_a_quote_finds_its_versions_and_only_them(tmp_path) -> None:
    from mlflow import MlflowClient

    mlflow = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for name in ("it's", "it"):
        mlflow.create_registered_model(name)
        mlflow.create_model_version(name, (tmp_path / name).as_uri())
    found = mlflow.search_model_versions(equals(name="it's"))
    assert [v.name for v in found] == ["it's"]
    # What a pasted filter did: the quote ended the string and the search failed.
    with pytest.raises(Exception, match=r"(?i)invalid|parse|syntax"):
        mlflow.search_model_versions("name='it's'")
