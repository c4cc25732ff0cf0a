"""`tetrad plan --web`: the page's API against `tetrad plan --json`, and the page itself in a real
headless browser (Debian's chromium and chromedriver, which `make test` installs; the browser
tests skip, saying why, only where they are not installed)."""

import io
import json
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tetrad.planner_web.details import MAX_DRAWN, drawn_microbatches

TRAIN = {"mode": "train", "options": {"model": "llama3-8b", "gpu": "a100-80gb", "num_gpus": 8,
                                      "pp": 2, "global_batch": 128, "top": 4}}
R1 = {"mode": "serve", "options": {"model": "deepseek-r1", "gpu": "h100-sxm", "num_gpus": 16,
                                   "gpus_per_node": 8, "dtype": "fp8", "top": 6}}
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def url():
    server = subprocess.Popen([sys.executable, "-m", "tetrad", "plan", "--web", "--port", "0",
                               "--no-open"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert "http://127.0.0.1:" in line, line
        yield line.split(" at ")[1].split()[0]
    finally:
        server.terminate()
        server.wait(timeout=30)


def post(url: str, request: dict) -> tuple[int, dict]:
    data = json.dumps(request).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "api/plan", data),
                                    timeout=300) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def cli_json(command: str) -> dict:
    argv = shlex.split(command)[1:] + ["--json"]  # "tetrad plan ..." as the page printed it
    out = subprocess.run([sys.executable, "-m", "tetrad", *argv], capture_output=True, text=True,
                         timeout=300)
    return json.loads(out.stdout)


@pytest.mark.parametrize("request_, command", [
    (TRAIN, "train --model llama3-8b --gpu a100-80gb --num-gpus 8 --pp 2 --global-batch 128 "
            "--top 4"),
    ({"mode": "train", "options": {**TRAIN["options"], "tokens": "1e10", "rank_by": "cost",
                                   "compile": True}},
     "train --model llama3-8b --gpu a100-80gb --num-gpus 8 --pp 2 --global-batch 128 "
     "--tokens 1e10 --compile --rank-by cost --top 4"),
    (R1, "serve --model deepseek-r1 --gpu h100-sxm --num-gpus 16 --gpus-per-node 8 --dtype fp8 "
         "--top 6")])
def test_the_page_answers_with_what_plan_json_prints(url, request_, command):
    status, answer = post(url, request_)
    assert status == 200 and answer["command"] == "tetrad plan " + command
    assert answer["plan"] == cli_json(answer["command"])


def test_every_stage_drawn_and_the_fullest_is_the_plans(url):
    _, answer = post(url, {**TRAIN, "detail": 1})
    config = answer["plan"]["configs"][1]
    stages = answer["detail"]["stages_gib"]
    assert answer["detail"]["row"] == 1 and len(stages) == config["parallel"]["pp"] == 2
    fullest = stages[config["fullest_stage"]]
    for key in ("params", "grads", "optimizer", "activations", "total"):
        assert fullest[key] == pytest.approx(config["memory_gib"][key], abs=1e-3)
    assert max(stage["total"] for stage in stages) == fullest["total"]


def test_the_timeline_is_the_plans_schedule_and_bubble(url):
    _, answer = post(url, TRAIN)
    config, timeline = answer["plan"]["configs"][0], answer["detail"]["timeline"]
    parallel = config["parallel"]
    assert (timeline["schedule"], timeline["pp"], timeline["vpp"]) == (
        parallel["schedule"], parallel["pp"], parallel["vpp"])
    m = timeline["microbatches_drawn"]
    assert m == timeline["microbatches"] == parallel["num_microbatches"]
    forward, backward = timeline["forward_s"], timeline["backward_s"]
    for spans in timeline["ranks"]:  # every chunk's forward and backward of every microbatch
        kinds = sorted((kind, stage, microbatch) for kind, stage, microbatch, _, _ in spans)
        assert len(kinds) == len(set(kinds)) == 2 * m * parallel["vpp"]
        busy = sum(end - start for *_, start, end in spans)
        assert busy == pytest.approx(m * (forward + backward), rel=1e-9)
    # The plan's bubble is the simulated makespan beyond the ranks' busy time.
    bubble = timeline["makespan_s"] - m * (forward + backward)
    assert bubble == pytest.approx(config["step_time_s"]["bubble"], rel=2e-3)


@pytest.mark.parametrize("schedule, pp, vpp, m", [("interleaved", 4, 8, 256), ("1f1b", 16, 1, 512),
                                                  ("dualpipe", 8, 2, 256), ("zbv", 64, 2, 512)])
def test_a_long_pass_is_drawn_with_fewer_microbatches(schedule, pp, vpp, m):
    shown = drawn_microbatches(schedule, pp, vpp, m)
    assert shown < m and shown % pp == 0
    if schedule in ("dualpipe", "zbv"):  # the V schedules' least
        assert shown == max(2 * pp, MAX_DRAWN // (pp * vpp) // pp * pp)
    else:
        assert pp * vpp * shown <= MAX_DRAWN < pp * vpp * (shown + pp)
    assert drawn_microbatches(schedule, pp, vpp, MAX_DRAWN // (pp * vpp)) == MAX_DRAWN // (pp * vpp)


def test_a_bad_request_is_one_line_of_json(url):
    status, answer = post(url, {**TRAIN, "options": {**TRAIN["options"], "num_gpus": 0}})
    assert status == 400 and answer["error"]["message"] == "--num-gpus must be at least 1, got 0"
    status, answer = post(url, {**TRAIN, "options": {**TRAIN["options"], "png": "x.png"}})
    assert status == 400 and answer["error"]["message"].startswith("unknown option 'png'")
    status, answer = post(url, {**TRAIN, "detail": 9})
    assert status == 400 and "detail must be a row" in answer["error"]["message"]


def test_an_uploaded_config_json_is_planned_as_its_folder(url, tmp_path):
    hf = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
          "num_key_value_heads": 4, "max_position_embeddings": 2048}
    request = {"mode": "serve", "options": {"gpu": "rtx-4090", "num_gpus": 1},
               "upload": {"name": "my-llama", "text": json.dumps(hf)}}
    status, answer = post(url, request)
    assert status == 200 and answer["plan"]["model"] == "my-llama"
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    direct = cli_json(f"tetrad plan serve --model {folder / 'config.json'} --gpu rtx-4090 "
                      f"--num-gpus 1")
    assert answer["plan"] == direct


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("Debian's chromium and chromium-driver are not installed (make test installs "
                    "them as root: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,2200"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(300)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, condition, seconds: int = 300):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, seconds, poll_frequency=0.2).until(lambda _: condition())


def drawn(driver, selector: str) -> list:
    """The on-screen sizes of the SVG shapes matching `selector`, each checked to be non-zero
    (asked in one script: thousands of WebDriver round trips would take minutes)."""
    sizes = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((shape) => {"
        "const box = shape.getBoundingClientRect(); return [box.width, box.height]; })", selector)
    assert all(width > 0 and height > 0 for width, height in sizes), selector
    return sizes


def colour_share(png: bytes, rgb: tuple[int, int, int]) -> float:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    counts = {colour: count for count, colour in image.getcolors(image.width * image.height)}
    return counts.get(rgb, 0) / (image.width * image.height)


def test_the_page_plans_and_draws_in_a_browser(url, browser):
    from selenium.webdriver.support.ui import Select

    browser.get(url)
    wait_for(browser, lambda: browser.find_element("tag name", "body").get_attribute(
        "data-ready") == "yes", 60)
    Select(browser.find_element("id", "opt-model")).select_by_value("llama3-8b")
    Select(browser.find_element("id", "opt-gpu")).select_by_value("a100-80gb")
    for field, value in (("opt-num_gpus", "8"), ("opt-pp", "2"), ("opt-global_batch", "128"),
                         ("opt-top", "4")):
        box = browser.find_element("id", field)
        box.clear()
        box.send_keys(value)
    browser.find_element("id", "plan-button").click()
    wait_for(browser, lambda: browser.find_elements("css selector", "#ranking tbody tr"))
    answer = browser.execute_script("return state.answer")
    assert answer["command"] == post(url, TRAIN)[1]["command"]
    rows = browser.find_elements("css selector", "#ranking tbody tr")
    assert len(rows) == len(answer["plan"]["configs"])
    # Stacked bars: params, grads, optimizer and activations of each of the 2 stages.
    assert len(drawn(browser, "#memory-chart rect.bar")) == 4 * 2
    assert len(drawn(browser, "#time-chart rect.bar")) >= len(rows)
    timeline = answer["detail"]["timeline"]
    assert len(drawn(browser, "#timeline-chart rect.span")) == sum(map(len, timeline["ranks"]))
    chart = browser.find_element("id", "memory-chart").screenshot_as_png
    assert colour_share(chart, (0x4e, 0x79, 0xa7)) > 0.01  # the params' blue, not a blank box
    page = browser.get_screenshot_as_png()
    assert colour_share(page, (255, 255, 255)) < 0.95
    rows[1].click()  # the second layout's stages and timeline
    wait_for(browser, lambda: browser.execute_script("return state.answer.detail.row") == 1)
    assert "2. " in browser.find_element("id", "memory-title").text


def test_the_r1_worked_answer_is_one_click_away(url, browser):
    browser.get(url)
    wait_for(browser, lambda: browser.find_element("tag name", "body").get_attribute(
        "data-ready") == "yes", 60)
    browser.find_element("id", "r1-button").click()
    wait_for(browser, lambda: browser.find_element("id", "worked").is_displayed())
    _, answer = post(url, R1)
    assert browser.execute_script("return state.answer.command") == answer["command"]
    fitting = [c for c in answer["plan"]["configs"] if c["fits"]]
    fastest = max(fitting, key=lambda c: c["decode_tokens_per_s"])
    text = browser.find_element("id", "worked").text
    assert f"{fastest['max_concurrent_sequences']} sequences in memory" in text
    assert browser.find_element("id", "summary").text.startswith("deepseek-r1 on 16 × h100-sxm")
    assert len(drawn(browser, "#memory-chart rect.bar")) >= 2 * len(answer["plan"]["configs"])
    assert not browser.find_element("id", "pipeline").is_displayed()


def test_plan_without_a_mode_or_with_a_bad_port_is_one_line(capsys):
    from tetrad.cli.main import main

    assert main(["plan"]) == 2
    assert capsys.readouterr().err == ("tetrad plan: error: say what to plan: tetrad plan "
                                       "train|serve ..., or tetrad plan --web\n")
    assert main(["plan", "--web", "--port", "70000", "--no-open"]) == 2
    assert capsys.readouterr().err == "tetrad plan: error: --port must be 0 to 65535, got 70000\n"
