"""The real English text ``attnquant verify`` measures on by default.

``data/botchan.txt`` is *Botchan (Master Darling)* by Natsume Sōseki,
translated by Yasotaro Morri, revised by J. R. Kennedy (1919): the text of
Project Gutenberg eBook #8868, chapters I to XI, with Project Gutenberg's
header, licence, translator's note and list of transcriber's corrections
removed (what remains is the public-domain work itself; the 1919 translation
is in the public domain in the United States).

It ships inside the package rather than as a dependency because no package
on PyPI installs a public-domain novel: this copy comes from the sentencepiece
0.2.1 source distribution on PyPI (``test/botchan.txt``), lines 120 to 3973,
carriage returns dropped. Its SHA-256 is pinned below, so the default slice
(the first ``N`` tokens of this file) is the same on every machine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TEXT_PATH = Path(__file__).resolve().parent / "data" / "botchan.txt"
DEFAULT_TEXT_SHA256 = "05cf9700a06d8d9308f3664b8322ee8ebe18dac0392fe939cc34442fd7327d6d"
DEFAULT_TEXT_NAME = "Botchan (Natsume Sōseki, tr. Morri 1919; Project Gutenberg #8868), ch. I-XI"


@dataclass(frozen=True)
class Text:
    """Text to measure on and a name that says where it came from."""

    name: str
    body: str


def default_text() -> Text:
    """The bundled novel, checked against its pinned hash.

    Raises:
        ValueError: the file is missing or differs from the pinned copy (the
            published numbers would no longer be reproducible).
    """
    if not DEFAULT_TEXT_PATH.is_file():
        raise ValueError(f"the bundled text {DEFAULT_TEXT_PATH} is missing; reinstall attnquant")
    raw = DEFAULT_TEXT_PATH.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DEFAULT_TEXT_SHA256:
        raise ValueError(
            f"the bundled text {DEFAULT_TEXT_PATH} has SHA-256 {digest}, "
            f"expected {DEFAULT_TEXT_SHA256}; reinstall attnquant"
        )
    return Text(DEFAULT_TEXT_NAME, raw.decode("utf-8"))


def load_text(path: Path | None) -> Text:
    """``path``'s UTF-8 text, or the bundled novel when ``path`` is None."""
    if path is None:
        return default_text()
    try:
        body = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read --text {path}: {error}") from error
    if not body.strip():
        raise ValueError(f"--text {path} is empty")
    return Text(str(path), body)
