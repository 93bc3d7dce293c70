"""``foretell.plugin.testing.check_storage_layout``: both built-in layouts pass it, and a layout
that breaks a promise of the contract (stores nothing, serves damaged bytes) fails it."""

from __future__ import annotations

import os

import pytest

from foretell.plugin.testing import check_storage_layout
from foretell.store.single_file import SingleFileLayout
from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout


def flip_a_data_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the last byte is tensor data in both layouts' files
    path.write_bytes(bytes(raw))


def test_the_single_file_layout_keeps_the_contract(tmp_path):
    check_storage_layout(lambda identity: SingleFileLayout(tmp_path, identity=identity),
                         damage=lambda layout, key: flip_a_data_byte(layout.path(key)))


def test_the_block_store_keeps_the_contract(tmp_path):
    def damage(layout, key):
        flip_a_data_byte(layout.files(key)[-1])  # its last block

    check_storage_layout(
        lambda identity: BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=8),
                                          identity=identity), damage=damage)


class ForgetfulLayout(SingleFileLayout):
    """Says it stored an entry and keeps nothing."""

    def write(self, entry):
        return True


class CredulousLayout(SingleFileLayout):
    """Reads without checking a single checksum."""

    def read(self, key):
        from foretell.store import StoreError
        from foretell.store import format as fmt
        from foretell.store.entry import Entry

        path = self.path(key)
        if not path.exists():
            return None
        try:
            with open(path, "rb") as fh:
                header = fmt.read_header(fh, path.stat().st_size, self.identity)
                layers = fmt.read_layers(fh, header, verify=False)
        except StoreError:  # another identity's, or a damaged header
            return None
        os.utime(path)  # marks it used, as the contract asks
        return Entry(tokens=header.tokens, layers=layers, namespace=header.namespace)


@pytest.mark.parametrize("broken, broken_promise", [
    (ForgetfulLayout, "headers"),
    (CredulousLayout, "a damaged entry was served"),
])
def test_a_layout_that_breaks_the_contract_fails_the_check(tmp_path, broken, broken_promise):
    with pytest.raises(AssertionError, match=broken_promise):
        check_storage_layout(lambda identity: broken(tmp_path, identity=identity),
                             damage=lambda layout, key: flip_a_data_byte(layout.path(key)))
