"""foretell's built-in block store: the ``blocks`` storage layout.

Entries are cut into blocks of a fixed number of tokens, named by their content, so entries
sharing a prompt prefix share their leading blocks and a growing conversation only adds
blocks (docs/block-store.md). Shaped exactly like a third party's plugin: one hook
implementation, registered through the ``foretell.plugins`` entry point.
"""

import foretell


@foretell.hookimpl
def foretell_register_storage_layouts(register):
    from foretell_blockstore.layout import BlockStoreConfig

    register(
        "blocks",
        "foretell_blockstore.layout:BlockStoreLayout",
        config=BlockStoreConfig,
        summary="content-addressed blocks of N tokens shared between entries, with safe GC",
    )
