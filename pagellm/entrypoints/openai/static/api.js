// What the page's two halves share: the API key and authorized fetches.

const KEY_STORAGE = "pagellm.apiKey";

export class Unauthorized extends Error {}

export function askForKey(reason) {
  const key = window.prompt(`${reason}\nAPI key (the server's --api-key):`,
                            localStorage.getItem(KEY_STORAGE) || "");
  if (key !== null) localStorage.setItem(KEY_STORAGE, key.trim());
  return key !== null;
}

// fetch with the stored key; a 401 asks for the key once and retries.
export async function api(path, options = {}, retry = true) {
  const headers = { ...(options.headers || {}) };
  const key = localStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    if (retry && askForKey("This server needs an API key.")) return api(path, options, false);
    throw new Unauthorized("missing or wrong API key");
  }
  return response;
}

// The message of an OpenAI-shaped error body, or the HTTP status.
export async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}
