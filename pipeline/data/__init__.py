"""The FFCV data layer: every training run reads ``.beton`` files through ``ffcv.loader.Loader``.

One concern per module:

- ``sources``   image sources a ``.beton`` is written from: ImageFolder trees, CIFAR pickles, digits
- ``writing``   ``write_beton``: parallel, atomic writes of a source into a ``.beton`` and its sidecar
- ``sidecar``   the JSON beside each ``.beton``: classes, counts, sizes, write options, SHA-256
- ``integrity`` ``check_beton``: a ``.beton`` is whole and matches its sidecar, before training starts
- ``verification`` ``verify_dataset``: a dataset anywhere checked against its sidecar, once per machine or shared run storage
- ``staging``   ``stage_dataset``: a URI copied once per node into a node-local cache
- ``ranged_reads`` ``copy_verified_ranges`` / ``verify_ranges``: parallel ranged reads, each chunk verified as it lands
- ``loaders``   ``build_train_loader`` / ``build_val_loader``: FFCV pipelines from the data config
- ``repeated_augmentation`` DeiT's RASampler as an ffcv traversal order (``data.repeated_augmentation``)
- ``augment``   DeiT's recipe on the device: ``BatchAugment`` (random erasing, Mixup/CutMix), no FFCV
- ``rand_augment_operation`` RandAugment as an FFCV pipeline operation
- ``rand_augment`` timm's RandAugment batched on torch ops (per-sample ops and magnitudes)
- ``prepare``   ``prepare_digits``: the offline dataset of the demo and the tests
- ``runtime``   containing ffcv's process-wide side effects (torch thread count, finalizer noise)

Nothing is imported here, so reading a sidecar never pays for importing ffcv and numba.
"""
