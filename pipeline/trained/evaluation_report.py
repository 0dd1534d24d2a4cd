"""What an evaluation shows: per-class accuracy, the confusion matrix as a table and an image, and each
sample's prediction, as the files ``vitsweep evaluate`` records with its MLflow run."""
from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

CONFUSION_PNG, CONFUSION_CSV = "confusion_matrix.png", "confusion_matrix.csv"
PER_CLASS_CSV, PREDICTIONS_CSV = "per_class_accuracy.csv", "predictions.csv"
_ANNOTATED_CLASSES = 20  # up to this many classes each cell shows its count
_NAMED_CLASSES = 60  # up to this many classes the axes name them


def per_class_rows(confusion: np.ndarray, classes: Sequence[str]) -> list[dict[str, object]]:
    """Each class's samples, correct top-1 predictions and accuracy (percent; empty with no samples)."""
    rows = []
    for index, name in enumerate(classes):
        samples, correct = int(confusion[index].sum()), int(confusion[index, index])
        rows.append({"class": name, "samples": samples, "correct": correct,
                     "accuracy": round(100.0 * correct / samples, 4) if samples else ""})
    return rows


def _csv(header: Sequence[str], rows: list[Sequence[object]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def per_class_csv(confusion: np.ndarray, classes: Sequence[str]) -> str:
    rows = per_class_rows(confusion, classes)
    return _csv(["class", "samples", "correct", "accuracy"], [list(row.values()) for row in rows])


def confusion_csv(confusion: np.ndarray, classes: Sequence[str]) -> str:
    """Rows: the true class; columns: the predicted class."""
    return _csv(["true \\ predicted", *classes],
                [[name, *confusion[index].tolist()] for index, name in enumerate(classes)])


def predictions_csv(labels: np.ndarray, predicted: np.ndarray, probability: np.ndarray,
                    classes: Sequence[str]) -> str:
    """One row per sample, in the dataset's order: its label, the top-1 prediction and its probability."""
    return _csv(["index", "label", "class", "predicted", "predicted_class", "probability", "correct"],
                [[index, int(label), classes[label], int(guess), classes[guess], f"{float(p):.6g}", int(label == guess)]
                 for index, (label, guess, p) in enumerate(zip(labels.tolist(), predicted.tolist(), probability))])


def plot_confusion(confusion: np.ndarray, classes: Sequence[str], title: str, path: Path) -> Path:
    """The matrix with each row (true class) shaded by its share of that class's samples."""
    count = len(classes)
    totals = confusion.sum(axis=1, keepdims=True)
    shares = np.divide(confusion, totals, out=np.zeros(confusion.shape, dtype=float), where=totals > 0)
    side = min(4 + 0.45 * count, 24)
    figure, axes = plt.subplots(figsize=(side + 1.5, side))
    shown = axes.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0)
    figure.colorbar(shown, ax=axes, fraction=0.046, pad=0.04, label="share of the true class")
    if count <= _NAMED_CLASSES:
        axes.set_xticks(range(count), [str(name) for name in classes], rotation=90 if count > 10 else 0)
        axes.set_yticks(range(count), [str(name) for name in classes])
    if count <= _ANNOTATED_CLASSES:
        for (row, column), value in np.ndenumerate(confusion):
            if value:
                axes.text(column, row, str(value), ha="center", va="center", fontsize=8,
                          color="white" if shares[row, column] > 0.5 else "black")
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100, metadata={"Title": title})  # the PNG says what it shows, for any viewer
    plt.close(figure)
    return path
