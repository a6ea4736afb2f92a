"""TFDS builder for the 1,797 handwritten 8x8 digits that ship inside scikit-learn.

`sklearn.datasets.load_digits()` reads them from the installed wheel (UCI "Optical
Recognition of Handwritten Digits", 8x8 images of 0..16 ink). The builder writes them
as array_record, split by image (MD5 of the image index: 70% train, 15% validation,
15% test), so validation and test digits are never seen in training.

  images, labels = load_split(data_dir, "test")   # uint8 [N, 8, 8] in 0..16, int64 [N]
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow_datasets as tfds

from rope_jax.data.splits import SPLITS, by_name

SIZE = 8  # pixels per side
MAX_INK = 16  # pixel values lie in 0..16
NUM_CLASSES = 10


def split_of(index: int) -> str:
    """The split of digit image `index` (fixed by the index, stable across machines)."""
    return by_name(f"digit-{index}", validation_percent=15, test_percent=15)


class RopeDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's 8x8 handwritten digits, split by image into train/validation/test."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "1,797 images split by MD5 of the index: ~70/15/15."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Handwritten digits from sklearn.datasets.load_digits: 8x8 images of "
                "integer ink 0..16 and their labels 0..9; `index` is the position in "
                "load_digits()."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=(SIZE, SIZE), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
                    "index": np.int32,
                }
            ),
            homepage="https://archive.ics.uci.edu/dataset/80",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Everything is read from the installed scikit-learn wheel.
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = digits.images.astype(np.uint8)
        return {split: self._generate_examples(images, digits.target, split) for split in SPLITS}

    def _generate_examples(self, images, labels, split):
        for i, (image, label) in enumerate(zip(images, labels, strict=True)):
            if split_of(i) == split:
                yield i, {"image": image, "label": int(label), "index": i}


def build(data_dir: str | None) -> tfds.core.DatasetBuilder:
    """The digits builder, generated as array_record on first use."""
    builder = RopeDigits(data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        config = tfds.download.DownloadConfig(try_download_gcs=False)
        builder.download_and_prepare(download_config=config, file_format="array_record")
    return builder


@functools.lru_cache(maxsize=8)
def load_split(data_dir: str | None, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [N, 8, 8] (ink 0..16) and labels int64 [N] of one split, by index.

    Read-only arrays, cached per process.
    """
    if split not in SPLITS:
        raise ValueError(f"digits split {split!r} is not one of {', '.join(SPLITS)}")
    source = build(data_dir).as_data_source(split=split)
    records = sorted((source[i] for i in range(len(source))), key=lambda r: int(r["index"]))
    images = np.stack([np.asarray(r["image"], np.uint8) for r in records])
    labels = np.array([int(r["label"]) for r in records], np.int64)
    images.flags.writeable = labels.flags.writeable = False
    return images, labels
