// The playground: plain DOM, no framework. Everything a user or the server wrote (prompts,
// revised prompts, error messages) goes into the page as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "vllm_omni_like.api_key";

// ---- the API -------------------------------------------------------------------------------
function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

class ApiError extends Error {}

async function failure(response) {
  // the server's own words: the OpenAI error envelope's message
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) {
      return new ApiError(`${response.status}: ${body.error.message}`);
    }
  } catch (_) { /* not JSON */ }
  return new ApiError(`${response.status} ${response.statusText}`);
}

async function api(path, options = {}) {
  const headers = { ...authHeaders(), ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) throw await failure(response);
  return response;
}

async function json(path, options) {
  return (await api(path, options)).json();
}

// Server-sent events from a POST (EventSource cannot POST): yields {event, data} objects.
async function* sse(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = null;
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data.push(line.slice(6));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// ---- small DOM helpers ---------------------------------------------------------------------
function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== null) node.textContent = text;
  return node;
}

function showError(id, error) {
  const box = $(id);
  if (!error) {
    box.hidden = true;
    box.textContent = "";
    return;
  }
  box.hidden = false;
  box.textContent = error instanceof ApiError ? error.message : `request failed: ${error.message}`;
}

function numberOrNull(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

function b64ToBlob(b64, type) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Blob([bytes], { type });
}

// ---- tabs ----------------------------------------------------------------------------------
function selectTab(name) {
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const on = tab.id === `tab-${name}`;
    tab.setAttribute("aria-selected", String(on));
    $(tab.getAttribute("aria-controls")).hidden = !on;
  }
}

// ---- models and status -----------------------------------------------------------------------
async function loadModels() {
  const { data } = await json("/v1/models");
  const fill = (id, output) => {
    const select = $(id);
    select.replaceChildren();
    for (const model of data.filter((m) => m.output === output)) {
      select.append(el("option", { value: model.id }, model.id));
    }
  };
  fill("image-model", "image");
  fill("edit-model", "image");
  fill("video-model", "video");
}

async function refreshStatus() {
  try {
    const response = await fetch("/health");
    const body = await response.json();
    $("status-summary").textContent = body.status;
    const rows = body.stages.map((s) => {
      const row = el("tr", { "data-state": s.state });
      row.append(
        el("td", {}, s.pipeline),
        el("td", {}, s.name),
        el("td", {}, s.state),
        el("td", {}, `${s.replicas_live}/${s.replicas_total}`),
      );
      return row;
    });
    $("status-table").tBodies[0].replaceChildren(...rows);
  } catch (error) {
    $("status-summary").textContent = "unreachable";
  }
}

// ---- images and edits: a grid that fills in as partial images stream -------------------------
function makeGrid(gridId, count) {
  const grid = $(gridId);
  grid.replaceChildren();
  const cells = [];
  for (let i = 0; i < count; i++) {
    const img = el("img", { alt: `image ${i + 1}`, class: "pending" });
    const caption = el("p", { class: "revised" });
    const download = el("a", { class: "download", hidden: "" }, "Download");
    const cell = el("figure", { class: "cell" });
    cell.append(img, caption, download);
    grid.append(cell);
    cells.push({ img, caption, download, done: false });
  }
  return cells;
}

async function streamInto(response, cells, format) {
  let next = 0;
  for await (const { event, data } of sse(response)) {
    if (data === "[DONE]") return;
    const body = JSON.parse(data);
    if (event === "error" || body.error) throw new ApiError(`error: ${body.error.message}`);
    if (event && event.endsWith(".partial_image")) {
      const url = `data:image/${format};base64,${body.b64_json}`;
      for (const cell of cells) if (!cell.done) cell.img.src = url;
    } else if (event && event.endsWith(".completed")) {
      const cell = cells[next++];
      if (!cell) continue;
      const blob = URL.createObjectURL(b64ToBlob(body.b64_json, `image/${format}`));
      cell.done = true;
      cell.img.src = blob;
      cell.img.classList.remove("pending");
      cell.img.alt = body.revised_prompt || "generated image";
      cell.caption.textContent = body.revised_prompt ? `drawn: ${body.revised_prompt}` : "";
      cell.download.href = blob;
      cell.download.download = `image-${body.seed ?? next}.${format}`;
      cell.download.hidden = false;
    }
  }
}

async function generateImages(event) {
  event.preventDefault();
  showError("image-error", null);
  const body = {
    prompt: $("image-prompt").value,
    model: $("image-model").value || undefined,
    size: $("image-size").value.trim() || "auto",
    n: numberOrNull("image-n") || 1,
    stream: true,
    partial_images: 2,
  };
  const optional = {
    negative_prompt: $("image-negative").value.trim() || null,
    num_inference_steps: numberOrNull("image-steps"),
    guidance_scale: numberOrNull("image-guidance"),
    seed: numberOrNull("image-seed"),
  };
  for (const [name, value] of Object.entries(optional)) if (value !== null) body[name] = value;
  const button = $("image-generate");
  button.disabled = true;
  const cells = makeGrid("image-grid", body.n);
  try {
    const response = await api("/v1/images/generations", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    await streamInto(response, cells, "png");
  } catch (error) {
    $("image-grid").replaceChildren();
    showError("image-error", error);
  } finally {
    button.disabled = false;
  }
}

// ---- edits: the uploaded image on a canvas, a mask painted over it ---------------------------
const editor = { image: null, mask: null, painting: false };

function drawEditor() {
  const canvas = $("edit-canvas");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (editor.image) ctx.drawImage(editor.image, 0, 0, canvas.width, canvas.height);
  if (editor.mask) {
    ctx.globalAlpha = 0.5;
    ctx.drawImage(editor.mask, 0, 0);
    ctx.globalAlpha = 1;
  }
}

async function loadEditImage() {
  const file = $("edit-file").files[0];
  if (!file) return;
  const image = await createImageBitmap(file);
  const canvas = $("edit-canvas");
  canvas.width = image.width;
  canvas.height = image.height;
  editor.image = image;
  editor.mask = document.createElement("canvas");
  editor.mask.width = image.width;
  editor.mask.height = image.height;
  drawEditor();
}

function paint(event) {
  if (!editor.painting || !editor.mask) return;
  const canvas = $("edit-canvas");
  const rect = canvas.getBoundingClientRect();
  const x = ((event.clientX - rect.left) * canvas.width) / rect.width;
  const y = ((event.clientY - rect.top) * canvas.height) / rect.height;
  const radius = (Number($("edit-brush").value) * canvas.width) / rect.width / 2;
  const ctx = editor.mask.getContext("2d");
  ctx.fillStyle = "#ffffff";
  ctx.beginPath();
  ctx.arc(x, y, radius, 0, 2 * Math.PI);
  ctx.fill();
  drawEditor();
}

function maskBlob() {
  // greyscale convention: white marks what to repaint, black what to keep
  const out = document.createElement("canvas");
  out.width = editor.mask.width;
  out.height = editor.mask.height;
  const ctx = out.getContext("2d");
  ctx.fillStyle = "#000000";
  ctx.fillRect(0, 0, out.width, out.height);
  ctx.drawImage(editor.mask, 0, 0);
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

async function generateEdit(event) {
  event.preventDefault();
  showError("edit-error", null);
  const file = $("edit-file").files[0];
  if (!file) {
    showError("edit-error", new ApiError("choose an image to edit first"));
    return;
  }
  const form = new FormData();
  form.append("image", file);
  form.append("prompt", $("edit-prompt").value);
  form.append("strength", $("edit-strength").value);
  form.append("stream", "true");
  form.append("partial_images", "2");
  if ($("edit-model").value) form.append("model", $("edit-model").value);
  if (editor.mask) form.append("mask", await maskBlob(), "mask.png");
  const button = $("edit-generate");
  button.disabled = true;
  const cells = makeGrid("edit-grid", 1);
  try {
    const response = await api("/v1/images/edits", { method: "POST", body: form });
    await streamInto(response, cells, "png");
  } catch (error) {
    $("edit-grid").replaceChildren();
    showError("edit-error", error);
  } finally {
    button.disabled = false;
  }
}

// ---- videos: jobs with live progress, played in the page --------------------------------------
const players = new Map(); // video id -> object URL of its loaded MP4

async function createVideo(event) {
  event.preventDefault();
  showError("video-error", null);
  const body = {
    prompt: $("video-prompt").value,
    model: $("video-model").value || undefined,
    size: $("video-size").value.trim() || "auto",
    seconds: $("video-seconds").value.trim() || undefined,
  };
  const steps = numberOrNull("video-steps");
  if (steps !== null) body.num_inference_steps = steps;
  try {
    await json("/v1/videos", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    await refreshVideos();
  } catch (error) {
    showError("video-error", error);
  }
}

function videoItem(video) {
  const item = el("li", { "data-id": video.id, "data-status": video.status });
  const title = el("p", { class: "prompt" }, video.prompt);
  const meta = el("p", { class: "meta" }, `${video.status} · ${video.size} · ${video.seconds} s`);
  const progress = el("progress", { max: "100", value: String(video.progress) });
  progress.setAttribute("aria-label", `progress of ${video.id}`);
  const remove = el("button", { type: "button", class: "delete" }, "Delete");
  remove.addEventListener("click", () => deleteVideo(video.id));
  item.append(title, meta, progress);
  if (video.error) item.append(el("p", { class: "error" }, video.error.message));
  if (video.status === "completed") {
    const player = el("video", { controls: "", muted: "", autoplay: "", loop: "", playsinline: "" });
    player.muted = true; // autoplay needs it, as an attribute and as a property
    player.setAttribute("aria-label", `video: ${video.prompt}`);
    item.append(player);
    loadVideo(video.id, player);
  }
  item.append(remove);
  return item;
}

async function loadVideo(id, player) {
  // a <video src> cannot send the API key: the MP4 is fetched with it, played as a blob
  try {
    if (!players.has(id)) {
      const blob = await (await api(`/v1/videos/${id}/content`)).blob();
      players.set(id, URL.createObjectURL(blob));
    }
    player.src = players.get(id);
    await player.play().catch(() => {}); // a browser may still refuse autoplay: controls stay
  } catch (error) {
    showError("video-error", error);
  }
}

let shown = "";

async function refreshVideos() {
  let list;
  try {
    list = await json("/v1/videos?limit=20");
  } catch (error) {
    showError("video-error", error);
    return;
  }
  const signature = JSON.stringify(list.data.map((v) => [v.id, v.status, v.progress]));
  if (signature === shown) return; // nothing changed: players keep playing
  shown = signature;
  $("video-list").replaceChildren(...list.data.map(videoItem));
}

async function deleteVideo(id) {
  try {
    await api(`/v1/videos/${id}`, { method: "DELETE" });
    if (players.has(id)) URL.revokeObjectURL(players.get(id));
    players.delete(id);
    await refreshVideos();
  } catch (error) {
    showError("video-error", error);
  }
}

// ---- start -----------------------------------------------------------------------------------
function start() {
  const key = $("api-key");
  key.value = localStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, key.value.trim());
    loadModels().catch((error) => showError("image-error", error));
  });
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    tab.addEventListener("click", () => selectTab(tab.id.slice(4)));
  }
  $("image-form").addEventListener("submit", generateImages);
  $("edit-form").addEventListener("submit", generateEdit);
  $("video-form").addEventListener("submit", createVideo);
  $("edit-file").addEventListener("change", () => loadEditImage().catch((e) => showError("edit-error", e)));
  $("edit-clear").addEventListener("click", () => {
    if (editor.mask) editor.mask.getContext("2d").clearRect(0, 0, editor.mask.width, editor.mask.height);
    drawEditor();
  });
  const canvas = $("edit-canvas");
  canvas.addEventListener("pointerdown", (e) => { editor.painting = true; paint(e); });
  canvas.addEventListener("pointermove", paint);
  for (const end of ["pointerup", "pointerleave"]) {
    canvas.addEventListener(end, () => { editor.painting = false; });
  }
  loadModels().catch((error) => showError("image-error", error));
  refreshStatus();
  setInterval(refreshStatus, 2000);
  setInterval(() => { if (!$("panel-videos").hidden) refreshVideos(); }, 500);
  $("tab-videos").addEventListener("click", refreshVideos);
}

document.addEventListener("DOMContentLoaded", start);
