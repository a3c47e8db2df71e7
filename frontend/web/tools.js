// The views of the other tasks, shown only when the server serves them:
// an embeddings similarity playground ("embed") and a transcription page
// ("transcription") for an audio file or the microphone. The microphone is
// recorded as raw samples and sent as a WAV file, which every server-side
// decoder reads (a browser's own recording formats vary).

import { call, postJson } from "./api.js";

function cosine(a, b) {
  let dot = 0;
  let na = 0;
  let nb = 0;
  for (let k = 0; k < a.length; k++) {
    dot += a[k] * b[k];
    na += a[k] * a[k];
    nb += b[k] * b[k];
  }
  return dot / Math.sqrt(na * nb);
}

// 16-bit PCM WAV of mono float samples.
function encodeWav(samples, rate) {
  const view = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const text = (offset, s) => [...s].forEach((c, k) => view.setUint8(offset + k, c.charCodeAt(0)));
  text(0, "RIFF");
  view.setUint32(4, 36 + samples.length * 2, true);
  text(8, "WAVEfmt ");
  view.setUint32(16, 16, true);
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true);
  view.setUint16(32, 2, true);
  view.setUint16(34, 16, true);
  text(36, "data");
  view.setUint32(40, samples.length * 2, true);
  samples.forEach((x, k) => view.setInt16(44 + k * 2, Math.max(-1, Math.min(1, x)) * 0x7fff, true));
  return new Blob([view], { type: "audio/wav" });
}

// Starts recording; the returned function stops it and resolves to a WAV blob.
async function record() {
  const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  const context = new AudioContext();
  const source = context.createMediaStreamSource(stream);
  const processor = context.createScriptProcessor(4096, 1, 1);
  const chunks = [];
  processor.onaudioprocess = (event) => chunks.push(new Float32Array(event.inputBuffer.getChannelData(0)));
  source.connect(processor);
  processor.connect(context.destination);
  return async () => {
    processor.disconnect();
    source.disconnect();
    stream.getTracks().forEach((track) => track.stop());
    await context.close();
    const samples = new Float32Array(chunks.reduce((n, c) => n + c.length, 0));
    let offset = 0;
    for (const chunk of chunks) {
      samples.set(chunk, offset);
      offset += chunk.length;
    }
    return encodeWav(samples, context.sampleRate);
  };
}

export function setUpTools(model, showError) {
  document.getElementById("embed-run").addEventListener("click", async () => {
    const input = [document.getElementById("embed-a").value, document.getElementById("embed-b").value];
    try {
      const body = await (await postJson("/v1/embeddings", { model: model(), input })).json();
      const [a, b] = body.data.map((d) => d.embedding);
      document.getElementById("embed-result").textContent = cosine(a, b).toFixed(4);
    } catch (error) {
      showError(error);
    }
  });
  const transcribe = async (file, name) => {
    const form = new FormData();
    form.append("file", file, name);
    form.append("model", model());
    const shown = document.getElementById("transcript");
    shown.textContent = "…";
    try {
      const body = await (await call("/v1/audio/transcriptions", { method: "POST", body: form })).json();
      shown.textContent = body.text.trim() || "(no speech)";
    } catch (error) {
      shown.textContent = "";
      showError(error);
    }
  };
  document.getElementById("transcribe-run").addEventListener("click", () => {
    const file = document.getElementById("audio-file").files[0];
    if (file) transcribe(file, file.name);
  });
  const mic = document.getElementById("record");
  let stop = null;
  mic.addEventListener("click", async () => {
    if (stop) {
      const finish = stop;
      stop = null;
      mic.textContent = "Record";
      transcribe(await finish(), "microphone.wav");
      return;
    }
    try {
      stop = await record();
      mic.textContent = "Stop and transcribe";
    } catch (error) {
      showError(error);
    }
  });
}
