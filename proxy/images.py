"""The image of an image-to-video request: from base64 or upload bytes to the uint8 HxWx3 RGB array
that travels to the stages.

Decoding is bounded: the pixel count is read from the file's header and checked before a pixel is
decoded (a few KB of PNG can claim gigapixels). The decoded image is then reduced to what the
request's size needs, so a large photo does not travel through the i2v stages at full size: the
VAE stage stretches the image to exactly width x height and the CLIP stage resizes its shorter
side and crops the centre, so the least image that loses nothing for either covers width x height
with the original aspect ratio. An image already within that is passed on untouched.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import re
import warnings
from typing import Iterator

import numpy as np
from PIL import Image, UnidentifiedImageError

from onepiece.config import MAX_IMAGE_ASPECT, MAX_IMAGE_PIXELS
from onepiece.proxy.errors import ApiError, bad_request

_B64_WS = re.compile(rb"\s+")
# The formats a request's image may be in: raster formats Pillow decodes itself. Open to every
# plugin, an EPS upload ran Ghostscript on the client's PostScript (no timeout, gs's -dSAFER
# escapes). (JPEG covers the MPO files many phones write.) Not ICO: Pillow decodes an icon's image
# as it opens it, before its size can be checked (an icon's header names at most 256x256, and the
# PNG inside may be 9400x9400).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_EXIF_ORIENTATION = 0x0112
_TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
# What turns an image of each EXIF orientation upright (ImageOps.exif_transpose's table). Done
# here, not by exif_transpose: that also writes the EXIF block again, and a tag holding a value
# of a type it does not take (a buggy camera's) raised struct.error there, for pixels that were fine.
_UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90}


def decode_base64_image(value: str, param: str = "input_reference") -> bytes:
    """Bytes of a base64 image given plain or as a ``data:image/...;base64,`` URL."""
    text = value.strip()
    if text.startswith(("http://", "https://")):
        # Fetching client-chosen URLs from inside the cluster would be an SSRF hole.
        raise bad_request(f"'{param}' as a remote URL is not supported; send the image itself "
                          f"(multipart upload, a data URL or base64)", param=param, code="unsupported_reference")
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or ";base64" not in head:
            raise bad_request(f"'{param}' data URL must be 'data:image/...;base64,<data>'", param=param,
                              code="invalid_base64")
        mime = head[5:].split(";")[0].strip().lower()
        if mime and not mime.startswith("image/"):
            raise bad_request(f"'{param}' data URL has type {mime!r}, expected an image", param=param,
                              code="invalid_image")
    try:
        raw = _B64_WS.sub(b"", text.encode("ascii"))
        raw += b"=" * (-len(raw) % 4)  # tolerate stripped padding
        data = base64.b64decode(raw, validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError):
        raise bad_request(f"'{param}' is not valid base64", param=param, code="invalid_base64") from None
    if not data:
        raise bad_request(f"'{param}' is empty", param=param, code="invalid_image")
    return data


def cover_size(width: int, height: int, need_w: int, need_h: int) -> tuple[int, int]:
    """The smallest size with the aspect ratio of ``width`` x ``height`` that covers ``need_w`` x
    ``need_h`` (or the size itself when it is no larger)."""
    scale = max(need_w / width, need_h / height)
    if scale >= 1:
        return width, height
    return max(need_w, round(width * scale)), max(need_h, round(height * scale))


def _too_large(param: str, what: str) -> ApiError:
    return bad_request(f"'{param}' {what}; at most {MAX_IMAGE_PIXELS} pixels ({MAX_IMAGE_PIXELS ** 0.5:.0f}^2) allowed",
                       param=param, code="image_too_large")


@contextlib.contextmanager
def _image_errors(param: str) -> Iterator[None]:
    """Whatever Pillow raises on bad data, as the 400 that names ``param``."""
    try:
        with warnings.catch_warnings():
            # PIL's own bomb check (at 89 Mpx) would otherwise only warn, and decode.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except ApiError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _too_large(param, "has more pixels than decoding is allowed") from None
    except UnidentifiedImageError:
        raise bad_request(f"'{param}' is not a readable image ({', '.join(FORMATS)})", param=param,
                          code="invalid_image") from None
    except (OSError, ValueError, SyntaxError, TypeError, EOFError, MemoryError) as e:  # truncated or corrupt data
        raise bad_request(f"'{param}' could not be decoded as an image: {e}", param=param, code="invalid_image") from None


def _open(data: bytes, param: str) -> Image.Image:
    """The image, its header read and checked, no pixel decoded yet (inside ``_image_errors``)."""
    img = Image.open(io.BytesIO(data), formats=FORMATS)
    w, h = img.size  # read from the header, before any pixel is decoded
    if w < 1 or h < 1:
        raise bad_request(f"'{param}' is {w}x{h} pixels", param=param, code="invalid_image")
    if w * h > MAX_IMAGE_PIXELS:
        raise _too_large(param, f"is {w}x{h}")
    if max(w, h) > MAX_IMAGE_ASPECT * min(w, h):
        raise bad_request(f"'{param}' is {w}x{h}: its sides differ more than {MAX_IMAGE_ASPECT}:1 allows (the image "
                          f"encoder scales the shorter side up, and the longer with it)", param=param,
                          code="invalid_image")
    return img


def check_image(data: bytes, param: str = "input_reference") -> None:
    """What the file's header allows to check, without decoding a pixel (microseconds): a request
    that can never succeed is told so before admission, not refused as if the set were busy."""
    with _image_errors(param):
        _open(data, param)


def decode_image(data: bytes, need: tuple[int, int] | None = None, param: str = "input_reference") -> np.ndarray:
    """The image as uint8 HxWx3 RGB, upright (EXIF), reduced to cover ``need`` = (width, height)
    when it is larger (see the module doc). 400 ``image_too_large`` for more than MAX_IMAGE_PIXELS,
    400 ``invalid_image`` for data that is no image. CPU-bound: callers run it off the event loop."""
    with _image_errors(param):
        img = _open(data, param)
        w, h = img.size
        orientation = img.getexif().get(_EXIF_ORIENTATION)  # phone photos store rotation in EXIF
        if need is not None:
            # JPEG decodes at 1/2, 1/4 or 1/8 scale for free; ask for what covers the need.
            nw, nh = need[::-1] if orientation in _TRANSPOSED else need
            img.draft(img.mode, cover_size(w, h, nw, nh))
        if orientation in _UPRIGHT:
            img = img.transpose(_UPRIGHT[orientation])
        if img.mode.startswith("I;16"):
            # 16-bit grey: convert() would clip each sample at 255 (a mid grey turns white); keep
            # the high byte, as Pillow does itself with 16-bit RGB.
            img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
        img = img.convert("RGB")
        if need is not None:
            size = cover_size(img.width, img.height, *need)
            if size != img.size:
                img = img.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        arr = np.asarray(img, dtype=np.uint8)
    return np.ascontiguousarray(arr)
