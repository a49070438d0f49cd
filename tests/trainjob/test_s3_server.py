"""The loopback S3 server the storage tests use answers pyarrow's and s3fs's clients, as MinIO would."""

import pyarrow.fs


def test_s3_server_answers_pyarrow_and_s3fs(s3, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"a": 1}')
    url = s3.upload_dir(str(tmp_path / "m"), "models/tiny")
    fs, path = pyarrow.fs.FileSystem.from_uri(url)
    with fs.open_input_stream(path + "/config.json") as f:
        assert f.read() == b'{"a": 1}'
    import s3fs

    assert s3fs.S3FileSystem().cat(f"{s3.bucket}/models/tiny/config.json") == b'{"a": 1}'
