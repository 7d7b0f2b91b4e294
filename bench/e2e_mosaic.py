"""Write the e2e benchmark's decoded samples as Mosaic Streaming MDS shards (run in the Mosaic venv).

    e2e_mosaic.py s3://BUCKET/PREFIX SHARE_DIR [SHARE_DIR ...]

Every sample of the tar shards in the directories, through `train_transform` (the same function
and seeds as the producers), in the producers' order, as columns key (str), img (uint8 3x224x224)
and cls (int). S3_ENDPOINT_URL and the AWS_* variables point it at the benchmark's S3 server.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
for _name in ("vision", "text", "multimodal"):  # dataset wrappers that need torchvision/transformers
    sys.modules[f"streaming.{_name}"] = types.ModuleType(f"streaming.{_name}")

from e2e_work import tar_samples, train_transform  # noqa: E402  (after the stubs)
from streaming import MDSWriter  # noqa: E402


def main() -> None:
    remote, dirs = sys.argv[1], sys.argv[2:]
    columns = {"key": "str", "img": "ndarray:uint8:3,224,224", "cls": "int"}
    n = 0
    with MDSWriter(out=remote, columns=columns, size_limit=1 << 25) as out:
        for d in dirs:
            for path in sorted(Path(d).glob("*.tar")):
                with open(path, "rb") as f:
                    for sample in tar_samples(f):
                        s = train_transform(sample)
                        out.write({"key": s["__key__"], "img": s["img"], "cls": s["cls"]})
                        n += 1
    print(n)


if __name__ == "__main__":
    main()
