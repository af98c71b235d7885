"""Stage cache keys: what changes them and what does not, and the marks that keep the cache from handing on an
output that no longer is what its key describes."""

from eagle3.config import load_config
from eagle3.stages import IN_PROGRESS, begin, cache_key, finish, recorded_key, stage_key
from test_config import TINY


def config(tmp_path, *overrides):
    return load_config(TINY, [f"run.dir={tmp_path / 'run'}", f"target.path={tmp_path / 'target'}", *overrides])


def test_keys_follow_what_a_stage_reads_and_nothing_else(tmp_path):
    base = config(tmp_path)
    assert stage_key("train", base, ["data"]) == stage_key("train", config(tmp_path, "serving.port=1234",
                                                                          "training.nproc_per_node=8"), ["data"])
    assert stage_key("train", base, ["data"]) != stage_key("train", config(tmp_path, "training.learning_rate=1e-3"), ["data"])
    assert stage_key("train", base, ["data"]) != stage_key("train", base, ["other data"])
    assert stage_key("train", base, ["data"]) != stage_key("train", config(tmp_path, "serving.num_steps=5"), ["data"])
    assert stage_key("regenerate", base, []) == stage_key("regenerate", config(tmp_path, "data.concurrency=3"), [])


def test_a_prompt_file_is_keyed_by_its_content(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    first = stage_key("regenerate", config(tmp_path, f"data.prompts={prompts}"), [])
    prompts.write_text('{"messages": [{"role": "user", "content": "b"}]}\n')
    assert stage_key("regenerate", config(tmp_path, f"data.prompts={prompts}"), []) != first


def test_the_cache_is_offered_a_key_only_for_an_output_finished_under_it(tmp_path):
    good, other = config(tmp_path), config(tmp_path, "training.learning_rate=1e-3")
    assert cache_key("train", good, ["d"]) is not None  # never ran here
    begin("train", good, ["d"], print)
    (tmp_path / "run" / "train" / "best").mkdir(parents=True)
    assert cache_key("train", good, ["d"]) is None  # in progress: a failed run's half output is no result
    finish("train", good, ["d"])
    assert cache_key("train", good, ["d"]) == stage_key("train", good, ["d"])
    begin("train", other, ["d"], print)  # another config's run overwrites it, and fails
    assert cache_key("train", good, ["d"]) is None


def test_changed_inputs_start_a_resuming_stage_afresh_and_a_crash_resumes(tmp_path):
    good, other = config(tmp_path), config(tmp_path, "training.learning_rate=1e-3")
    checkpoint = tmp_path / "run" / "train" / "checkpoints" / "step-100"
    checkpoint.mkdir(parents=True)
    begin("train", good, ["d"], print)  # crashed: still in progress under the same key
    begin("train", good, ["d"], print)
    assert checkpoint.is_dir()  # the re-run resumes
    lines = []
    begin("train", other, ["d"], lines.append)
    assert not checkpoint.exists() and "its inputs changed" in lines[0]
    assert recorded_key(other, "train") == IN_PROGRESS + stage_key("train", other, ["d"])


def test_more_samples_other_thresholds_or_benchmark_prompts_keep_the_regenerated_samples_and_other_prompts_do_not(tmp_path):
    """data.num_samples, data.quality and the benchmark's held-out set change regeneration's cache key, not what it
    resumes from."""
    written = tmp_path / "run" / "data" / "regen" / "samples-00000.jsonl"
    written.parent.mkdir(parents=True)
    written.write_text("{}\n")
    begin("regenerate", config(tmp_path), [], print)
    finish("regenerate", config(tmp_path), [])
    for overrides in (["data.num_samples=5000"], ["data.num_samples=3", "data.quality.max_empty_share=0.5"],
                      ["benchmark.num_prompts=7"], ["benchmark.max_new_tokens=9"]):
        refined = config(tmp_path, *overrides)
        assert cache_key("regenerate", refined, []) is None  # not the same output: the stage runs
        begin("regenerate", refined, [], print)
        assert written.is_file()  # ... and resumes from the samples already written
    begin("regenerate", config(tmp_path, "data.temperature=0.7"), [], print)
    assert not written.exists()
