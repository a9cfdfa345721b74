"""Assets in (`flide_sdk.images`): every way to pass an image decodes to the same RGB pixels and hash, and every bad
input is an InvalidAssetError naming its placeholder, before any pixel of an oversized image is decoded."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image

from flide_sdk.errors import FlideError, InvalidAssetError
from flide_sdk.images import (
    MAX_IMAGE_PIXELS,
    check_references,
    decode_assets,
    split_at_placeholders,
)


def picture(width: int = 7, height: int = 5, mode: str = "RGB") -> Image.Image:
    image = Image.new(mode, (width, height))
    image.putdata([((3 * i) % 256, (5 * i) % 256, (7 * i) % 256)[: len(mode)] if len(mode) > 1 else i % 256
                   for i in range(width * height)])
    return image


def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def asset(data: bytes, **fields) -> dict:
    return {"type": "image", "data_base64": base64.b64encode(data).decode(), **fields}


def test_every_form_decodes_to_the_same_pixels_and_hash(tmp_path):
    # mutation: hashing the encoded bytes instead of the pixels (png vs PIL vs path differ)
    image = picture()
    png = encoded(image, "PNG")
    (tmp_path / "a.png").write_bytes(png)
    decoded = decode_assets({"dict": asset(png, format="png"), "mime": asset(png, mime_type="image/png"),
                             "pil": image, "bytes": png, "path": tmp_path / "a.png", "str": str(tmp_path / "a.png"),
                             "url": {"data_base64": "data:image/png;base64," + base64.b64encode(png).decode()}})
    digests = {d.digest for d in decoded.values()}
    assert len(digests) == 1
    for d in decoded.values():
        assert d.image.mode == "RGB" and d.size == (7, 5)
        assert d.image.tobytes() == image.tobytes()
    other = decode_assets({"x": picture(7, 6)})["x"]
    assert other.digest not in digests  # mutation: a digest of the size alone


def test_exif_orientation_and_modes_are_applied():
    # mutation: dropping exif_transpose leaves the 7x5 image unrotated
    image = picture()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    jpeg = encoded(image, "JPEG", exif=exif.tobytes())
    assert decode_assets({"j": jpeg})["j"].size == (5, 7)
    grey = decode_assets({"g": encoded(picture(mode="L"), "PNG")})["g"]
    assert grey.image.mode == "RGB"


@pytest.mark.parametrize(
    "value, reason",
    [
        ({"type": "image", "format": "png"}, "no data"),
        ({"data_base64": ""}, "no data"),
        (b"", "no data"),
        ({"data_base64": "not base64!!"}, "not base64"),
        ({"data_base64": base64.b64encode(b"hello, not an image").decode()}, "not a png/jpeg/webp image"),
        (asset(b"GIF89a" + bytes(40), format="gif"), "format 'gif' is not served"),
        (encoded(picture(mode="P"), "GIF"), "not a png/jpeg/webp image"),
        ("/nonexistent/dir/image.png", "cannot read"),
        (3.5, "an image is an asset dict"),
        ({"type": "audio", "data_base64": "AAAA"}, "asset type 'audio'"),
    ],
)
def test_bad_assets_are_typed(value, reason):
    with pytest.raises(InvalidAssetError, match=reason) as info:
        decode_assets({"<img>": value})
    assert info.value.name == "<img>"
    assert isinstance(info.value, FlideError) and isinstance(info.value, ValueError)


def test_declared_format_must_match_the_data():
    # mutation: not comparing the declared format to the one Pillow reads
    png = encoded(picture(), "PNG")
    with pytest.raises(InvalidAssetError, match="declared jpeg, but the data is png"):
        decode_assets({"a": asset(png, format="jpg")})
    with pytest.raises(InvalidAssetError, match="disagree"):
        decode_assets({"a": asset(png, format="png", mime_type="image/jpeg")})


def test_truncated_image_is_refused():
    # mutation: not catching the decoder's OSError (Pillow opens from the header alone, fails on load)
    png = encoded(picture(64, 64), "PNG")
    with pytest.raises(InvalidAssetError, match="cannot be decoded"):
        decode_assets({"t": png[: len(png) // 2]})
    jpeg = encoded(picture(64, 64), "JPEG")
    with pytest.raises(InvalidAssetError, match="cannot be decoded"):
        decode_assets({"t": jpeg[: len(jpeg) // 2]})


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny (wrong) data chunk: decoding would fail or explode."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("width, height", [(20_000, 20_000), (8193, 8192)])
def test_too_many_pixels_refused_from_the_header(width, height):
    # mutation: checking the size after load() decodes 400M pixels (or fails as truncated, not as too large)
    assert width * height > MAX_IMAGE_PIXELS
    with pytest.raises(InvalidAssetError, match="pixels"):
        decode_assets({"big": png_header_only(width, height)})
    with pytest.raises(InvalidAssetError, match="more than"):
        decode_assets({"big": asset(png_header_only(width, height), format="png")})


def test_zero_size_images_are_refused():
    with pytest.raises(InvalidAssetError, match="0x5 pixels"):
        decode_assets({"z": Image.new("RGB", (0, 5))})
    with pytest.raises(InvalidAssetError):
        decode_assets({"z": png_header_only(0, 0)})


def test_assets_must_be_a_mapping_of_names():
    with pytest.raises(InvalidAssetError, match="must map"):
        decode_assets([picture()])
    with pytest.raises(InvalidAssetError, match="non-empty string"):
        decode_assets({"": picture()})
    assert decode_assets(None) == {} and decode_assets({}) == {}


def test_placeholders_found_as_the_pipeline_finds_them():
    # mutation: names tried in the given order ('img' first would cut 'img-10' into 'img' + '-10')
    names = ["img", "img-10", "<x>"]
    assert split_at_placeholders("see img-10 and img, <x><x>!", names) == [
        "see ", 1, " and ", 0, ", ", 2, 2, "!"]
    assert split_at_placeholders("img", names) == [0]
    assert split_at_placeholders("plain", []) == ["plain"]
    state = {"screen": "<x>", "note": "a \"quoted\" img"}
    text = json.dumps(state, ensure_ascii=False)
    assert split_at_placeholders(text, names).count(2) == 1


def test_references_without_an_asset_are_refused():
    reference = "<image:" + "ab" * 16 + ">"
    check_references(f"look at {reference}", [reference])
    with pytest.raises(InvalidAssetError, match="no asset has this name") as info:
        check_references(f"look at {reference}", ["<image:" + "cd" * 16 + ">"])
    assert info.value.name == reference
