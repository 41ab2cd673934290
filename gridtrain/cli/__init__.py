"""The ``gridtrain`` command line: the parser and ``main`` (``parser``), what ``train`` and ``generate``
do once their flags are valid (``commands``), and ``gridtrain plot`` (``plot``).

The top of the package: it may import anything; nothing imports it.
"""

from gridtrain.cli.parser import main

__all__ = ["main"]
