"""load_image: every odd image mode becomes correct RGB; every bad file gives its exact error."""

from __future__ import annotations

import io
import os
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.data.images import load_image
from captioner.errors import DataError, ImageLoadError


def _pixel(path: Path, xy: tuple[int, int] = (0, 0)) -> tuple[int, int, int]:
    image = load_image(path)
    assert image.mode == "RGB"
    return image.getpixel(xy)


def _close(a: tuple[int, ...], b: tuple[int, ...], tol: int = 6) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


# ----------------------------------------------------------------------------- modes


def test_rgb_jpeg_loads_fully(tmp_path: Path) -> None:
    path = tmp_path / "rgb.jpg"
    Image.new("RGB", (30, 20), (200, 30, 40)).save(path, quality=95)
    image = load_image(path)
    assert image.size == (30, 20) and _close(image.getpixel((15, 10)), (200, 30, 40))


@pytest.mark.parametrize("mode, value, expected", [("L", 77, 77), ("1", 1, 255), ("1", 0, 0)])
def test_greyscale_8_bit(tmp_path: Path, mode: str, value: int, expected: int) -> None:
    path = tmp_path / f"grey_{mode}.png"
    Image.new(mode, (4, 3), value).save(path)
    assert _pixel(path) == (expected,) * 3


def test_16_bit_png_is_scaled_not_clipped(tmp_path: Path) -> None:
    values = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)  # 0, 1, 128, 255 after scaling
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    assert Image.open(path).mode.startswith("I")
    image = load_image(path)
    assert [image.getpixel((x, 0)) for x in range(4)] == [(0,) * 3, (1,) * 3, (128,) * 3, (255,) * 3]


def test_32_bit_integer_tiff(tmp_path: Path) -> None:
    path = tmp_path / "int.tif"
    Image.new("I", (3, 3), 65535).save(path)
    assert Image.open(path).mode == "I"
    assert _pixel(path) == (255, 255, 255)
    outside = tmp_path / "int_range.tif"
    Image.fromarray(np.array([[-1000, 0, 99000]], dtype=np.int32)).save(outside)
    image = load_image(outside)  # values outside 0..65535 are min-max scaled
    assert [image.getpixel((x, 0))[0] for x in range(3)] == [0, 3, 255]  # 1000 / 100000 * 255 = 2.55


def test_float_tiff(tmp_path: Path) -> None:
    path = tmp_path / "float.tif"
    Image.fromarray(np.array([[0.0, 0.25, 1.0]], dtype=np.float32)).save(path)
    assert Image.open(path).mode == "F"
    image = load_image(path)
    assert [image.getpixel((x, 0))[0] for x in range(3)] == [0, 64, 255]


def test_rgba_is_composited_on_white(tmp_path: Path) -> None:
    rgba = np.zeros((1, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)  # opaque red
    rgba[0, 1] = (255, 0, 0, 0)  # fully transparent
    rgba[0, 2] = (0, 0, 255, 128)  # half blue
    path = tmp_path / "alpha.png"
    Image.fromarray(rgba).save(path)
    image = load_image(path)
    assert image.getpixel((0, 0)) == (255, 0, 0)
    assert image.getpixel((1, 0)) == (255, 255, 255)
    assert _close(image.getpixel((2, 0)), (127, 127, 255), tol=2)


def test_la_is_composited_on_white(tmp_path: Path) -> None:
    path = tmp_path / "la.png"
    Image.merge("LA", [Image.new("L", (2, 1), 0), Image.frombytes("L", (2, 1), bytes([255, 0]))]).save(path)
    image = load_image(path)
    assert image.getpixel((0, 0)) == (0, 0, 0) and image.getpixel((1, 0)) == (255, 255, 255)


def test_palette_with_transparency(tmp_path: Path) -> None:
    image = Image.new("P", (2, 1))
    image.putpalette([0, 200, 0, 200, 0, 0] + [0] * 762)
    image.putpixel((0, 0), 0)
    image.putpixel((1, 0), 1)
    path = tmp_path / "palette.png"
    image.save(path, transparency=0)  # index 0 (green) is transparent
    loaded = load_image(path)
    assert loaded.getpixel((0, 0)) == (255, 255, 255) and loaded.getpixel((1, 0)) == (200, 0, 0)


def test_cmyk_jpeg(tmp_path: Path) -> None:
    path = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(path, quality=95)
    assert Image.open(path).mode == "CMYK"
    assert _close(_pixel(path, (8, 8)), (255, 0, 0), tol=10)


def test_exif_rotated_jpeg_is_transposed(tmp_path: Path) -> None:
    # stored 60 wide x 30 high, red block in the stored top-left corner, blue elsewhere
    stored = Image.new("RGB", (60, 30), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 15, 15))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation 6: display = stored rotated 90 degrees clockwise
    path = tmp_path / "rotated.jpg"
    stored.save(path, exif=exif, quality=95)
    image = load_image(path)
    assert image.size == (30, 60)  # width and height swapped
    assert _close(image.getpixel((25, 5)), (255, 0, 0), tol=30)  # the red corner is now top-right
    assert _close(image.getpixel((5, 5)), (0, 0, 255), tol=30)
    assert _close(image.getpixel((25, 50)), (0, 0, 255), tol=30)


def test_animated_gif_gives_first_frame(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(path).n_frames == 3
    assert _pixel(path, (4, 4)) == (255, 0, 0)


def test_accepts_str_paths(tmp_path: Path) -> None:
    path = tmp_path / "s.png"
    Image.new("RGB", (2, 2), (1, 2, 3)).save(path)
    assert load_image(str(path)).getpixel((1, 1)) == (1, 2, 3)


# ----------------------------------------------------------------------------- bad files


def _png_bytes(size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _chunk_offset(data: bytes, kind: bytes) -> tuple[int, int]:
    """(offset of the chunk's type field, data length) of the first chunk of this type."""
    at = data.index(kind)
    return at, struct.unpack(">I", data[at - 4: at])[0]


def _with_ihdr_size(data: bytes, width: int, height: int) -> bytes:
    at, length = _chunk_offset(data, b"IHDR")
    body = struct.pack(">II", width, height) + data[at + 12: at + 4 + length]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + body) & 0xFFFFFFFF)
    return data[:at + 4] + body + crc + data[at + 8 + length:]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jpg"
    with pytest.raises(ImageLoadError, match=f"^{path}: file not found$"):
        load_image(path)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ImageLoadError, match=f"^{tmp_path}: is a directory, not an image file$"):
        load_image(tmp_path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "locked.png"
    path.write_bytes(_png_bytes())
    path.chmod(0)
    try:
        with pytest.raises(ImageLoadError, match=f"^{path}: permission denied$"):
            load_image(path)
    finally:
        path.chmod(0o644)


def test_permission_error_is_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "locked.png"
    path.write_bytes(_png_bytes())

    real_open = os.open

    def deny(file: os.PathLike, flags: int, *args: object, **kwargs: object) -> int:
        if Path(file) == path:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)  # what opening a chmod 000 file does (root would not see it)
    with pytest.raises(ImageLoadError, match=f"^{path}: permission denied$"):
        load_image(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jpg"
    path.write_bytes(b"")
    with pytest.raises(ImageLoadError, match=f"^{path}: file is empty$"):
        load_image(path)


def test_text_file_renamed_jpg(tmp_path: Path) -> None:
    path = tmp_path / "notes.jpg"
    path.write_text("these are not pixels\n" * 20)
    with pytest.raises(ImageLoadError, match=f"^{path}: not an image file$") as info:
        load_image(path)
    assert isinstance(info.value, DataError)


def test_truncated_jpeg(tmp_path: Path) -> None:
    full = tmp_path / "full.jpg"
    Image.effect_noise((120, 90), 60).convert("RGB").save(full, quality=90)
    path = tmp_path / "cut.jpg"
    path.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(ImageLoadError, match=rf"^{path}: truncated or corrupt image \(image file is truncated"):
        load_image(path)


def test_truncated_png(tmp_path: Path) -> None:
    data = _png_bytes()
    for keep in (len(data) - 12, len(data) // 2, 40):  # no IEND, half the pixels, header only
        path = tmp_path / f"cut{keep}.png"
        path.write_bytes(data[:keep])
        with pytest.raises(ImageLoadError, match=rf"^{path}: truncated or corrupt image \(.+\)$"):
            load_image(path)


def test_png_with_bad_data_crc(tmp_path: Path) -> None:
    data = bytearray(_png_bytes())
    at, length = _chunk_offset(bytes(data), b"IDAT")
    data[at + 4 + length] ^= 0xFF  # first byte of the IDAT chunk's CRC
    path = tmp_path / "badcrc.png"
    path.write_bytes(bytes(data))
    with pytest.raises(ImageLoadError, match=rf"^{path}: truncated or corrupt image \(.*checksum.*\)$"):
        load_image(path)


def test_png_with_bad_header_crc(tmp_path: Path) -> None:
    data = bytearray(_png_bytes())
    at, length = _chunk_offset(bytes(data), b"IHDR")
    data[at + 4 + length] ^= 0xFF
    path = tmp_path / "badheader.png"
    path.write_bytes(bytes(data))
    with pytest.raises(ImageLoadError, match=rf"^{path}: truncated or corrupt image \(unreadable PNG header\)$"):
        load_image(path)


def test_decompression_bomb_refused_before_decoding(tmp_path: Path) -> None:
    # header claims 10000x10000 but the file holds 40x30 pixels: decoding would fail differently
    path = tmp_path / "bomb.png"
    path.write_bytes(_with_ihdr_size(_png_bytes(), 10000, 10000))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning must not escape either
        with pytest.raises(ImageLoadError,
                           match=rf"^{path}: image too large \(10000x10000 pixels, limit 64 megapixels\)$"):
            load_image(path)


def test_huge_bomb_beyond_pil_limit(tmp_path: Path) -> None:
    path = tmp_path / "bigbomb.png"
    path.write_bytes(_with_ihdr_size(_png_bytes(), 20000, 20000))
    with pytest.raises(ImageLoadError, match=rf"^{path}: image too large \(400 megapixels, limit 64 megapixels\)$"):
        load_image(path)


def test_max_pixels_is_an_argument(tmp_path: Path) -> None:
    path = tmp_path / "small.png"
    Image.new("RGB", (20, 10), (5, 5, 5)).save(path)
    with pytest.raises(ImageLoadError, match=rf"^{path}: image too large \(20x10 pixels, limit 199 pixels\)$"):
        load_image(path, max_pixels=199)
    assert load_image(path, max_pixels=200).size == (20, 10)
    assert load_image(path, max_pixels=None).size == (20, 10)
