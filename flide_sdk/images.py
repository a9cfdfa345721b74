"""Images in a request (`assets=`): what users pass, decoded to RGB with typed errors, and where a text names them.

An asset is a System One asset dict (`data_base64`, optional `format` / `mime_type`), a PIL image, the bytes of an
image file, or a path to one. Files are opened with Pillow (the `images` extra) and their header checked (a format
served, the one declared, a size within MAX_IMAGE_PIXELS) before any pixel is decoded; then decoded whole (a
truncated file raises), EXIF-transposed and converted to RGB, as transformers' `load_image` does. Each image
carries a content hash of its pixels, which a session chains into its history's hashes. Placeholders are found as
`pipeline("decision")` finds them: every asset name, longest first, anywhere in the rendered text; a TypeSafe
`<image:...>` reference with no asset is refused. Every failure is an InvalidAssetError naming the placeholder.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from flide_sdk.errors import InvalidAssetError, MissingExtraError

if TYPE_CHECKING:
    import PIL.Image

MAX_IMAGE_PIXELS = 1 << 26  # 8192 x 8192; larger images are refused from their header, before decoding
MAX_ASSET_BYTES = 1 << 26  # an encoded image file's bytes
SERVED_FORMATS = ("PNG", "JPEG", "WEBP")  # Pillow's names of the formats decoded
DECLARED_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
REFERENCE = re.compile(r"<image:[0-9a-f]{32}>")  # what a TypeSafe `Image` writes into a state
Assets = Mapping[str, Any]
"""A request's images by placeholder: asset dicts (`data_base64`), PIL images, file bytes or paths."""


@dataclass(frozen=True)
class DecodedImage:
    """One asset decoded: its placeholder, its RGB pixels, and `digest`, a 128-bit hash of its size and pixels
    (the same picture hashes the same whichever way it was passed)."""

    name: str
    image: PIL.Image.Image
    digest: bytes

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.image.size


def pillow() -> Any:
    """The PIL package, or MissingExtraError naming the extra that installs it."""
    try:
        import PIL.Image
        import PIL.ImageOps
    except ImportError as error:
        raise MissingExtraError("images need Pillow: pip install 'flide_sdk[images]'") from error
    return PIL


def decode_assets(assets: Mapping[str, Any] | None) -> dict[str, DecodedImage]:
    """Every asset of a request decoded (`{}` for none); InvalidAssetError for the first that cannot be served."""
    if assets is None:
        return {}
    if not isinstance(assets, Mapping):
        raise InvalidAssetError("assets", f"must map placeholder names to images, got a {type(assets).__name__}")
    if not assets:
        return {}
    pil = pillow()
    decoded = {}
    for name, asset in assets.items():
        if not isinstance(name, str) or not name:
            raise InvalidAssetError(str(name), "a placeholder name must be a non-empty string")
        decoded[name] = decode_asset(pil, name, asset)
    return decoded


def decode_asset(pil: Any, name: str, asset: Any) -> DecodedImage:
    """One asset as a DecodedImage (see the module docstring for what an asset may be; one decoded already is
    taken as it is)."""
    if isinstance(asset, DecodedImage):
        return asset if asset.name == name else DecodedImage(name, asset.image, asset.digest)
    if isinstance(asset, pil.Image.Image):
        return _finish(pil, name, asset)
    if isinstance(asset, Mapping):
        data, declared = _asset_dict(name, asset)
    elif isinstance(asset, (bytes, bytearray, memoryview)):
        data, declared = bytes(asset), None
    elif isinstance(asset, (str, os.PathLike)):
        data, declared = _read_file(name, Path(asset)), None
    else:
        raise InvalidAssetError(name, f"an image is an asset dict, a PIL image, bytes or a path; got a "
                                      f"{type(asset).__name__}")
    if not data:
        raise InvalidAssetError(name, "the asset has no data")
    if len(data) > MAX_ASSET_BYTES:
        raise InvalidAssetError(name, f"{len(data)} bytes; at most {MAX_ASSET_BYTES} are read")
    try:
        image = pil.Image.open(io.BytesIO(data), formats=SERVED_FORMATS)
    except pil.Image.DecompressionBombError:
        raise InvalidAssetError(name, f"more than {MAX_IMAGE_PIXELS} pixels") from None
    except (OSError, ValueError, SyntaxError) as error:  # UnidentifiedImageError is an OSError
        raise InvalidAssetError(name, f"not a {'/'.join(f.lower() for f in SERVED_FORMATS)} image ({error})") from None
    if declared is not None and image.format != declared:
        raise InvalidAssetError(name, f"declared {declared.lower()}, but the data is {image.format.lower()}")
    return _finish(pil, name, image)


def _asset_dict(name: str, asset: Mapping) -> tuple[bytes, str | None]:
    """(the file bytes, the Pillow format declared or None) of a System One asset dict."""
    if asset.get("type", "image") != "image":
        raise InvalidAssetError(name, f"asset type {asset.get('type')!r} is not served (only 'image')")
    declared = None
    for key, value in (("format", asset.get("format")), ("mime_type", asset.get("mime_type"))):
        if value is None:
            continue
        label = value.lower().removeprefix("image/") if isinstance(value, str) else None
        if label not in DECLARED_FORMATS:
            raise InvalidAssetError(name, f"{key} {value!r} is not served ({', '.join(sorted(DECLARED_FORMATS))})")
        if declared is not None and DECLARED_FORMATS[label] != declared:
            raise InvalidAssetError(name, "format and mime_type disagree")
        declared = DECLARED_FORMATS[label]
    text = asset.get("data_base64")
    if text is None or text == "":
        raise InvalidAssetError(name, "the asset has no data (data_base64)")
    if not isinstance(text, str):
        raise InvalidAssetError(name, f"data_base64 must be a string, got a {type(text).__name__}")
    if text.startswith("data:"):  # a data URL: its payload follows the comma
        text = text.partition(",")[2]
    if len(text) > MAX_ASSET_BYTES * 4 // 3 + 4:
        raise InvalidAssetError(name, f"data_base64 holds more than {MAX_ASSET_BYTES} bytes")
    try:
        return base64.b64decode("".join(text.split()), validate=True), declared
    except (binascii.Error, ValueError) as error:
        raise InvalidAssetError(name, f"data_base64 is not base64 ({error})") from None


def _read_file(name: str, path: Path) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_ASSET_BYTES:
            raise InvalidAssetError(name, f"{path}: {size} bytes; at most {MAX_ASSET_BYTES} are read")
        return path.read_bytes()
    except OSError as error:
        raise InvalidAssetError(name, f"cannot read {path} ({error.strerror or error})") from None


def _finish(pil: Any, name: str, image: PIL.Image.Image) -> DecodedImage:
    """Size checks from the header, then the pixels decoded, EXIF-transposed, RGB, hashed."""
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InvalidAssetError(name, f"the image is {width}x{height} pixels")
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidAssetError(name, f"{width}x{height} is more than {MAX_IMAGE_PIXELS} pixels")
    try:
        image.load()
        image = pil.ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, SyntaxError) as error:
        raise InvalidAssetError(name, f"cannot be decoded ({error})") from None
    digest = xxhash.xxh3_128(f"{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return DecodedImage(name, image, digest.digest())


def split_at_placeholders(text: str, names: Iterable[str]) -> list[str | int]:
    """`text` cut at every placeholder of `names` (the longest first where they overlap), as the pipeline cuts it:
    text pieces (empty ones dropped) and, for each placeholder found, its index in `names`."""
    names = list(names)
    if not names:
        return [text] if text else []
    order = sorted(range(len(names)), key=lambda i: len(names[i]), reverse=True)
    pattern = re.compile("|".join(f"({re.escape(names[i])})" for i in order))
    parts: list[str | int] = []
    last = 0
    for match in pattern.finditer(text):
        if match.start() > last:
            parts.append(text[last:match.start()])
        parts.append(order[match.lastindex - 1])
        last = match.end()
    if last < len(text):
        parts.append(text[last:])
    return parts


def check_references(text: str, names: Iterable[str]) -> None:
    """InvalidAssetError for a TypeSafe `<image:...>` reference in `text` that no asset names."""
    known = set(names)
    for match in REFERENCE.finditer(text):
        if match[0] not in known:
            raise InvalidAssetError(match[0], "the state refers to this image, but no asset has this name")
